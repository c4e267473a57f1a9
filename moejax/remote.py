"""A `gs://` path's bucket reached once, fast, before a command uses it (`check`).

gcsfs retries a failed request 6 times with backoff (51-83 s), then logs each failure with
its aiohttp traceback; a command given a gs:// path with no network or no credentials used
to hang that long and print hundreds of lines. `check` asks first, bounded:

1. a TCP connection to the endpoint gcsfs will use (`STORAGE_EMULATOR_HOST`, else
   storage.googleapis.com:443), at most `CONNECT_SECONDS`: no network, a wrong host or a
   stopped emulator is refused here, in one line;
2. gcsfs's `info` of the path (a missing object is an answer), at most `PROBE_SECONDS`: an
   authentication or permission error (401, 403) comes back at once and is refused in one
   line; a slower failure (the retries above) is refused when the bound runs out.

Each bucket is checked once per process (per endpoint); after that, gcsfs's own retries
apply to transient errors of a running job. Only `gs://` is checked. docs/failures.md.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import urllib.parse

from moejax.errors import UserError

CONNECT_SECONDS = 5.0
PROBE_SECONDS = 20.0
GOOGLE = "https://storage.googleapis.com"
_reached: set[tuple[str, str]] = set()


def bucket(url: str) -> str:
  return url.split("://", 1)[1].split("/", 1)[0]


def endpoint() -> str:
  """The URL gcsfs sends requests to (its `_location`: the emulator's, else Google's)."""
  emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
  if emulator in ("", "default"):
    return GOOGLE
  return emulator if emulator.startswith(("http://", "https://")) else f"http://{emulator}"


def environment() -> str:
  """The variables that decide where requests go and who makes them, as they are set."""
  creds = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS") or "unset"
  emulator = os.environ.get("STORAGE_EMULATOR_HOST") or "unset: storage.googleapis.com"
  return (
    f"credentials: GOOGLE_APPLICATION_CREDENTIALS ({creds}) or `gcloud auth "
    f"application-default login`; STORAGE_EMULATOR_HOST ({emulator}) for an emulator"
  )


def check(url: str, where: str = "") -> None:
  """A one-line UserError, naming `where` (default: `url`; e.g. `--out gs://b/d`), the
  bucket, the error class and `environment()`, unless `url`'s bucket answers (see the
  module docstring)."""
  url = os.fspath(url)
  if not url.startswith("gs://"):
    return
  where, b, at = where or url, bucket(url), endpoint()
  if (at, b) in _reached:
    return
  _connect(at, where, b)
  _ask(url, where, b)
  _reached.add((at, b))


def _connect(at: str, where: str, b: str) -> None:
  if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")):
    return  # the request goes through a proxy: only `_ask` can tell
  u = urllib.parse.urlsplit(at)
  port = u.port or (443 if u.scheme == "https" else 80)
  try:
    socket.create_connection((u.hostname, port), timeout=CONNECT_SECONDS).close()
  except OSError as e:
    why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    raise UserError(
      f"{where}: cannot reach Cloud Storage for bucket {b} at {u.hostname}:{port} ({why}); "
      f"check the network and {environment()}"
    ) from None


def _ask(url: str, where: str, b: str) -> None:
  """gcsfs's `info(url)` in a daemon thread, waited for `PROBE_SECONDS` at most, its logger
  quiet meanwhile (it logs every failure with a traceback)."""
  import fsspec  # pylint: disable=import-outside-toplevel  (gcsfs: etils[epath-gcs])

  result: list[BaseException | None] = []

  def ask():
    try:
      fsspec.filesystem("gs").info(url)
      result.append(None)
    except FileNotFoundError:  # an answer: the bucket is there, the path not (yet)
      result.append(None)
    except Exception as e:  # noqa: BLE001  (HttpError, aiohttp's, google-auth's: all refusals)
      result.append(e)

  log = logging.getLogger("gcsfs")
  level = log.level
  log.setLevel(logging.CRITICAL)
  try:
    thread = threading.Thread(target=ask, name="moejax-gcs-probe", daemon=True)
    thread.start()
    thread.join(PROBE_SECONDS)
  finally:
    log.setLevel(level)
  if not result:
    raise UserError(
      f"{where}: no answer from Cloud Storage for bucket {b} in {PROBE_SECONDS:.0f} s "
      f"(gcsfs retries failed requests); {environment()}"
    )
  e = result[0]
  if e is not None:
    why = (str(e).splitlines() or [""])[0][:160]
    raise UserError(
      f"{where}: Cloud Storage refused bucket {b} ({type(e).__name__}: {why}); {environment()}"
    )
