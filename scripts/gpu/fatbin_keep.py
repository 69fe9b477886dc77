"""Keeps one GPU architecture's kernels in a CUDA library and zeroes the rest, for transport.

    python3 fatbin_keep.py LIB SM OUT

A CUDA library (ONNX Runtime's libonnxruntime_providers_cuda.so: 284 MB, of which 218 MB are
kernels for sm_75 to sm_120) carries one cubin per kernel and architecture in its `.nv_fatbin`
section. The driver loads the cubin of the device's architecture and reads no other, so zeroing
the others (in place: every offset and size stays as it was) changes nothing for that device and
lets the file compress to a fraction (52 MB of xz for sm_90 instead of 186 MB). Used by
scripts/gpu/pack.sh to send the CUDA flavour to a GPU node in transfers of limited size; never
for a library installed for general use. PTX entries are kept whatever their architecture (the
driver may compile them for a device that has no cubin).
"""

import struct
import subprocess
import sys

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX = 1


def fatbin_section(path):
    out = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if ".nv_fatbin" in line:
            fields = line.split("]", 1)[1].split()
            return int(fields[3], 16), int(fields[4], 16)
    sys.exit(f"{path}: no .nv_fatbin section")


def main():
    path, sm, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    data = bytearray(open(path, "rb").read())
    offset, size = fatbin_section(path)
    pos, end = offset, offset + size
    kept = zeroed = 0
    while pos + 16 <= end:
        magic, _version, header, fat_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # containers are 8-byte aligned
            continue
        entry, entries_end = pos + header, pos + header + fat_size
        while entry < entries_end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            arch = struct.unpack_from("<I", data, entry + 28)[0]
            start = entry + entry_header
            if kind == KIND_PTX or arch == sm:
                kept += payload
            else:
                data[start:start + payload] = bytes(payload)
                zeroed += payload
            entry = start + payload
        pos = entries_end
    if kept == 0:
        sys.exit(f"{path}: no kernel for sm_{sm}; nothing written")
    open(out, "wb").write(data)
    print(f"{path}: kept {kept >> 20} MB of kernels for sm_{sm} (and PTX), zeroed {zeroed >> 20} MB", file=sys.stderr)


if __name__ == "__main__":
    main()
