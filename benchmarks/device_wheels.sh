#!/usr/bin/env bash
# The wheels a GPU host without network needs for moejax when its Python 3.12 already has jax
# 0.11.2 with the cuda13 plugin, optax, orbax-checkpoint, chex, etils, tokenizers, matplotlib,
# jaxtyping and most of their needs (as the image of the committed H200 figures did): these
# are what such an environment lacks (found by importing moejax with only those packages and these wheels, and
# running the tiny CPU benchmark). Run it on a machine with network; it writes them to .whl/
# (ignored by git: .git/info/exclude). Copy the checkout with .whl/ to the host and install
# there (docs/performance.md, "A GPU host without network"):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
# flax is taken at moejax's 3.12 pin (0.12.12), whatever the host's is.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >>.git/info/exclude
WHEELS=(
  flax==0.12.12 tokamax==0.0.13 grain==0.2.18 array-record==0.8.6 ml-collections==1.1.0
  qwix==0.1.8 einshape==1.0 immutabledict==4.3.1 tensorboardX==2.6.5 typeguard==2.13.3
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  portpicker==1.6.0 xprof==2.24.2 fire==0.7.1 termcolor==3.3.0 six==1.17.0
)
for plat in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
  manylinux_2_17_x86_64 manylinux2014_x86_64 any; do
  PLATS+=(--platform "$plat")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATS[@]}" -d .whl "${WHEELS[@]}"
du -sh .whl
