#!/usr/bin/env bash
# Fetches a real English training text: Jane Austen's six novels (Sense and Sensibility, Pride and
# Prejudice, Mansfield Park, Emma, Northanger Abbey, Persuasion; about 4 MB of UTF-8 text, in the
# public domain) from the Debian package r-cran-janeaustenr. The package holds the novels as R
# character vectors (one element per line) in a zlib-compressed R lazy-load database; a small
# python3 reader turns them back into plain text, with no R needed.
#
# usage: scripts/fetch-text.sh [OUTPUT]     (default data/raw/book.txt, relative to the repo root)
# then:  merak prepare-data --input data/raw/book.txt --output data/book
#
# Needs apt-get (no root needed once the package lists exist; as root it runs `apt-get update`
# itself if the package cannot be found), dpkg-deb and python3. Does nothing if OUTPUT already
# exists and is non-empty.
set -euo pipefail

PKG=r-cran-janeaustenr
RDB=usr/lib/R/site-library/janeaustenr/data/Rdata.rdb

out="${1:-data/raw/book.txt}"
# A relative default is relative to the repo root; a relative argument to the caller's directory.
if [ $# -eq 0 ]; then
  out="$(cd "$(dirname "$0")/.." && pwd)/$out"
elif [[ "$out" != /* ]]; then
  out="$PWD/$out"
fi

if [ -s "$out" ]; then
  echo "already there: $out ($(wc -c <"$out") bytes); nothing to do"
  exit 0
fi

for tool in apt-get dpkg-deb python3; do
  command -v "$tool" >/dev/null || { echo "error: $tool not found (needed to fetch $PKG)" >&2; exit 1; }
done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp" "$out.tmp"' EXIT

echo "downloading Debian package $PKG ..."
if ! (cd "$tmp" && apt-get download -q "$PKG" >"$tmp/apt.log" 2>&1); then
  if [ "$(id -u)" -eq 0 ]; then
    echo "apt-get download failed; running apt-get update and retrying ..."
    apt-get update -qq >>"$tmp/apt.log" 2>&1 || true
    (cd "$tmp" && apt-get download -q "$PKG" >>"$tmp/apt.log" 2>&1) || {
      cat "$tmp/apt.log" >&2
      echo "error: could not download the Debian package $PKG (is a Debian package mirror reachable?)" >&2
      exit 1
    }
  else
    cat "$tmp/apt.log" >&2
    echo "error: could not download the Debian package $PKG; if apt says it cannot locate it," \
      "run 'sudo apt-get update' first" >&2
    exit 1
  fi
fi

deb="$(ls "$tmp"/"$PKG"_*.deb 2>/dev/null | head -n1)"
[ -n "$deb" ] || { echo "error: apt-get download produced no .deb for $PKG" >&2; exit 1; }
dpkg-deb -x "$deb" "$tmp/root"
[ -f "$tmp/root/$RDB" ] || { echo "error: $RDB not found in $(basename "$deb")" >&2; exit 1; }

mkdir -p "$(dirname "$out")"
python3 - "$tmp/root/$RDB" "$out.tmp" <<'PY'
# Rdata.rdb is a sequence of records: a 4-byte big-endian length, then a zlib stream holding one
# R object serialized in XDR format. Here each object is one novel: a character vector (STRSXP)
# whose elements are the lines of the text (NA for a missing line).
import struct, sys, zlib

src, dst = sys.argv[1], sys.argv[2]
data = open(src, "rb").read()

def fail(msg):
    sys.exit(f"error: unexpected format in {src}: {msg}")

def strings(buf):
    if buf[:2] != b"X\n":
        fail("not an XDR R serialization")
    version, = struct.unpack(">i", buf[2:6])
    pos = 14  # magic, format version, writer version, minimal reader version
    if version == 3:
        nelen, = struct.unpack(">i", buf[pos:pos + 4])
        pos += 4 + nelen  # native encoding name
    elif version != 2:
        fail(f"serialization version {version}")
    flags, n = struct.unpack(">ii", buf[pos:pos + 8])
    pos += 8
    if flags & 0xFF != 16:  # STRSXP
        fail(f"object of SEXP type {flags & 0xFF}, not a character vector")
    lines = []
    for _ in range(n):
        cflags, length = struct.unpack(">ii", buf[pos:pos + 8])
        pos += 8
        if cflags & 0xFF != 9:  # CHARSXP
            fail(f"element of SEXP type {cflags & 0xFF}")
        if length < 0:  # NA_character_
            lines.append("")
            continue
        raw = buf[pos:pos + length]
        pos += length
        latin1 = (cflags >> 12) & 4
        lines.append(raw.decode("latin-1" if latin1 else "utf-8"))
    return lines

novels, pos = [], 0
while pos < len(data):
    z = zlib.decompressobj()
    buf = z.decompress(data[pos + 4:])
    if not z.eof:
        fail("truncated zlib record")
    pos = len(data) - len(z.unused_data)
    lines = strings(buf)
    while lines and not lines[-1].strip():
        lines.pop()
    while lines and not lines[0].strip():
        lines.pop(0)
    novels.append("\n".join(line.rstrip() for line in lines))

if len(novels) < 6:
    fail(f"found {len(novels)} texts, expected 6 novels")
with open(dst, "w", encoding="utf-8", newline="\n") as f:
    f.write("\n\n\n\n".join(novels) + "\n")
print(f"extracted {len(novels)} novels")
PY
mv "$out.tmp" "$out"
echo "wrote $out: $(wc -c <"$out") bytes, $(wc -l <"$out") lines ($(du -h "$out" | cut -f1))"
