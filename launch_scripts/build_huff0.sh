#!/usr/bin/env bash
# Build huff0 (the Huffman coder inside zstd, from FiniteStateEntropy's lib/) as a shared
# library for launch_scripts/huff0.py, the reference the codec's entropy stage is timed
# against. Only this script is ours: the C sources stay where they were fetched.
#
#   launch_scripts/build_huff0.sh SOURCE_DIR [OUTPUT]
#
# SOURCE_DIR: a checkout of https://github.com/Cyan4973/FiniteStateEntropy (or its lib/).
# OUTPUT: the library to write (default ~/.cache/comm_codec/libhuff0.so, where
# launch_scripts/huff0.py looks first; COMM_CODEC_HUFF0 names another).
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 SOURCE_DIR [OUTPUT]  (SOURCE_DIR: FiniteStateEntropy checkout or its lib/)" >&2
    exit 2
fi
src=$1
[ -f "$src/lib/huf_compress.c" ] && src=$src/lib
if [ ! -f "$src/huf_compress.c" ]; then
    echo "$0: no huf_compress.c in $1 or $1/lib" >&2
    exit 2
fi
out=${2:-${XDG_CACHE_HOME:-$HOME/.cache}/comm_codec/libhuff0.so}
mkdir -p "$(dirname "$out")"
cc=${CC:-gcc}
# -O3 -march=native: the build a compression engineer would time it with.
"$cc" -O3 -march=native -shared -fPIC -DNDEBUG -I"$src" -o "$out.tmp" \
    "$src/huf_compress.c" "$src/huf_decompress.c" "$src/entropy_common.c" \
    "$src/fse_compress.c" "$src/fse_decompress.c" "$src/hist.c"
mv "$out.tmp" "$out"
# The test suite cannot build it (the sources are not on PyPI), so the build checks itself.
python "$(dirname "$0")/huff0.py" --self-test --lib "$out" >&2
echo "$out"
