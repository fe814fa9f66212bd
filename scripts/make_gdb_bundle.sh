#!/usr/bin/env bash
# A self-contained gdb >= 14 for a machine that has none and no package access (the GPU machine):
# Debian trixie's gdb (16.x) with every shared library it loads, glibc and its loader included, so
# it runs whatever the host's own libraries are, plus the Python stdlib its embedded Python wants.
# gdb >= 14 is needed there: older gdb assumes a fixed XSAVE layout and fails on AMX CPUs with
# "Couldn't write extended state status". Writes .gdb/gdb-bundle.tar.xz (ignored by git).
# On the other machine:
#   mkdir -p /tmp/gdb && tar xJf .gdb/gdb-bundle.tar.xz -C /tmp/gdb && export GPUMON_GDB=/tmp/gdb/gdb
# Needs apt and network access to deb.debian.org (any Debian/Ubuntu host; nothing is installed).
set -euo pipefail
cd "$(dirname "$0")/.."
suite=${SUITE:-trixie}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
echo "deb http://deb.debian.org/debian $suite main" > "$work/sources.list"
apt_opts=(-o "Dir::Etc::sourcelist=$work/sources.list" -o Dir::Etc::sourceparts=-
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache"
          -o Dir::State::status=/dev/null -o APT::Sandbox::User=root)
apt-get "${apt_opts[@]}" update >/dev/null
# The library closure of gdb (apt's own dependency walk; the non-library parts are not needed).
pkgs=$(apt-cache "${apt_opts[@]}" depends --recurse --no-recommends --no-suggests --no-conflicts \
         --no-breaks --no-replaces --no-enhances gdb | grep -v '^ \|<' | sort -u \
       | grep -E '^(gdb$|lib)' | grep -v perl)
mkdir -p "$work/debs"
( cd "$work/debs" && apt-get "${apt_opts[@]}" download $pkgs >/dev/null )
for f in "$work"/debs/*.deb; do dpkg-deb -x "$f" "$work/root"; done
root=$work/root
libdirs=$root/usr/lib/x86_64-linux-gnu:$root/lib/x86_64-linux-gnu
loader=$root/usr/lib64/ld-linux-x86-64.so.2
b=$work/bundle
mkdir -p "$b/lib" "$b/share" "$b/python"
cp "$root/usr/bin/gdb" "$b/gdb.bin"
cp -r "$root/usr/share/gdb/." "$b/share/"
cp -r "$root/usr/lib/python3.13" "$b/python/"
"$loader" --list --library-path "$libdirs" "$b/gdb.bin" \
  | awk '/=>/ {print $3}' | sort -u | while read -r lib; do cp -L "$lib" "$b/lib/"; done
# The loader is what runs, so it is what `ps` and /proc/PID/comm name: call it gdb.
mkdir -p "$b/bin" && cp -L "$loader" "$b/bin/gdb"
cat > "$b/gdb" <<'SH'
#!/bin/sh
# Debian's gdb, run with the libraries (glibc included) and the Python stdlib it came with.
d=$(dirname "$(readlink -f "$0")")
PYTHONHOME="$d/python" PYTHONPATH= exec "$d/bin/gdb" --library-path "$d/lib" \
  "$d/gdb.bin" --data-directory="$d/share" "$@"
SH
chmod +x "$b/gdb"
# PYTHONHOME is <prefix>: the stdlib must sit at <prefix>/lib/python3.13.
mkdir -p "$b/python/lib" && mv "$b/python/python3.13" "$b/python/lib/"
"$b/gdb" --version | head -1
"$b/gdb" -nx -batch -ex 'python print("gdb python ok")'
mkdir -p .gdb
tar cJf .gdb/gdb-bundle.tar.xz -C "$b" .
ls -la .gdb/gdb-bundle.tar.xz
