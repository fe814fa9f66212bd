#!/usr/bin/env bash
# A self-contained gdb for a machine that has none and no package access (the GPU machine):
# Debian's gdb-minimal with every shared library it loads, glibc and its loader included, so it
# runs whatever the host's own libraries are. Writes .gdb/gdb-bundle.tar.xz (~10 MB, ignored by
# git). On the other machine:
#   mkdir -p /tmp/gdb && tar xJf .gdb/gdb-bundle.tar.xz -C /tmp/gdb && export GPUMON_GDB=/tmp/gdb/gdb
# Needs a Debian/Ubuntu machine with apt (run `apt-get update` once first).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
( cd "$work" && apt-get download gdb-minimal libdebuginfod1 libipt2 libxxhash0 libgmp10 \
    libexpat1 libreadline8 >/dev/null )
for f in "$work"/*.deb; do dpkg-deb -x "$f" "$work/root"; done
b="$work/bundle"
mkdir -p "$b/lib" "$b/share"
cp "$work/root/usr/bin/gdb" "$b/gdb.bin"
cp -r "$work/root/usr/share/gdb/." "$b/share/" 2>/dev/null || true
LD_LIBRARY_PATH="$work/root/usr/lib/x86_64-linux-gnu" ldd "$b/gdb.bin" \
  | awk '/=>/ {print $3}' | sort -u | while read -r lib; do cp -L "$lib" "$b/lib/"; done
cp -L /lib64/ld-linux-x86-64.so.2 "$b/"
cat > "$b/gdb" <<'SH'
#!/bin/sh
# Debian's gdb-minimal, run with the libraries (and the glibc) it came with.
d=$(dirname "$(readlink -f "$0")")
exec "$d/ld-linux-x86-64.so.2" --library-path "$d/lib" "$d/gdb.bin" --data-directory="$d/share" "$@"
SH
chmod +x "$b/gdb"
"$b/gdb" --version | head -1
mkdir -p .gdb
tar cJf .gdb/gdb-bundle.tar.xz -C "$b" .
ls -la .gdb/gdb-bundle.tar.xz
