#!/bin/sh
# The device check, run on a GPU machine with no internet from the repository root (README, "GPU"):
# installs the wheels `make device-bundle` put in .device/a, joins the embedded model's two halves
# (.device/a and .device/b travel in two calls: each call's tree is limited to 64 MiB), and runs
# `tokenspeed bench gpu`, whose JSON goes to $OUT/gpu (written after each section).
set -eu
D=.device
SITE=/tmp/tokenspeed-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$D"/a/wheels/*.whl
ln -sfn "$PWD/engine" "$SITE/tokenspeed"  # the package from the working tree, without building it
cat "$D"/a/model.gguf.part-* "$D"/b/model.gguf.part-* > /tmp/embedded.gguf
export PYTHONPATH="$SITE" TOKENSPEED_BFCL="$PWD/$D/a/bfcl" TOKENSPEED_CACHE=/tmp/tokenspeed-cache PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
exec python3 -m tokenspeed.bench gpu --device cuda --out "${OUT:-bench-out}/gpu" --model /tmp/embedded.gguf
