#!/usr/bin/env bash
# The page engine on aarch64 without an aarch64 machine: cross-compiles gdskv/native/_pages.c
# (the extension, -Werror) and a static test program around its CRC-32C, then runs that under
# qemu-user: the ARMv8 CRC instructions must be chosen and agree with the portable table and
# CRC-32C's check value. Needs gcc-aarch64-linux-gnu and qemu-user (Debian/Ubuntu packages);
# Python's headers are this machine's (only declarations are used).
#
#   bash tests/aarch64_native_check.sh [PYTHON]
#
# Its output: bench/results/cpu-2026-11-27/native/ (aarch64_check.txt in raw.tar.xz).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-python3}
cc=aarch64-linux-gnu-gcc
inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "+ $($cc --version | head -1)"
$cc -Wall -Wextra -Wno-unused-parameter -Werror -O3 -fPIC -shared -DPy_LIMITED_API=0x030B0000 \
    -I"$inc" gdskv/native/_pages.c -o "$tmp/_pages.abi3.so"
echo "+ the extension builds for aarch64: $(file -b "$tmp/_pages.abi3.so" | cut -d, -f1-2)"
echo "+ CRC instructions in it: $(aarch64-linux-gnu-objdump -d "$tmp/_pages.abi3.so" | grep -c 'crc32c[bx]')"
cat > "$tmp/check.c" <<EOF
#include "$PWD/gdskv/native/_pages.c"
#include <stdio.h>
int main(void) {
    make_tables();
    choose_crc();
    printf("implementation: %s\n", crc_implementation);
    int bad = ~crc_update(~0u, (const unsigned char *)"123456789", 9) != 0xE3069283u;
    static unsigned char buf[200000];
    uint32_t x = 12345;
    for (size_t i = 0; i < sizeof buf; i++) {
        x = x * 1103515245u + 12345u;
        buf[i] = (unsigned char)(x >> 24);
    }
    size_t sizes[] = {0, 1, 7, 8, 9, 767, 768, 769, 24575, 24576, 24577, 100001, 199990};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
        for (size_t skew = 0; skew < 8; skew++)
            if (crc_update(~0u, buf + skew, sizes[s]) != crc_table_update(~0u, buf + skew, sizes[s])) {
                printf("differs from the table: %zu bytes at +%zu\n", sizes[s], skew);
                bad = 1;
            }
    printf(bad ? "FAILED\n" : "check value and 104 buffers equal to the table\n");
    return bad;
}
EOF
# static, the Python API left unresolved: the program calls none of it
$cc -O2 -static -DPy_LIMITED_API=0x030B0000 -I"$inc" "$tmp/check.c" -o "$tmp/check" \
    -Wl,--unresolved-symbols=ignore-all 2>&1 | grep -v -i warning || true
echo "+ qemu-aarch64 (default CPU):"
qemu-aarch64 "$tmp/check"
