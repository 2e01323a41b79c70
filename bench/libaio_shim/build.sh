#!/bin/sh
# Build libaio.so from libaio.c into $1 (default: ./build) and print the environment that makes DeepSpeed's
# async_io op (ZeRO-Infinity NVMe offload) build and load against it, for hosts without the libaio-dev package:
#     eval "$(sh bench/libaio_shim/build.sh /tmp/libaio_shim)"
set -e
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/build}
mkdir -p "$out/include" "$out/lib"
cp "$here/libaio.h" "$out/include/"
cc -O2 -fPIC -shared -Wall -Wl,-soname,libaio.so.1 -o "$out/lib/libaio.so.1" "$here/libaio.c"
ln -sf libaio.so.1 "$out/lib/libaio.so"
echo "export CPATH=$out/include\${CPATH:+:\$CPATH} LIBRARY_PATH=$out/lib\${LIBRARY_PATH:+:\$LIBRARY_PATH}" \
     "LD_LIBRARY_PATH=$out/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH} CFLAGS=\"-I$out/include \$CFLAGS\"" \
     "LDFLAGS=\"-L$out/lib \$LDFLAGS\""
