#!/bin/sh
# The compiler launcher of amp_source_check: runs the compile command with -fsyntax-only (the source is parsed and its
# templates checked, with its own includes, but no code is generated), then creates the empty object file the build
# expects. The depfile is still written, so an edited header checks its sources again.
out=""
prev=""
for arg in "$@"; do
  [ "$prev" = "-o" ] && out=$arg
  prev=$arg
done
"$@" -fsyntax-only && : > "$out"
