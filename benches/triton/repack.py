"""Repack a wheel smaller: leave out members matching patterns, put files in place of members,
compress with LZMA (pip installs such wheels), and write its RECORD again.

    python repack.py SRC.whl DST.whl [--drop PATTERN]... [--replace MEMBER=FILE]...
"""

import argparse
import base64
import fnmatch
import hashlib
import zipfile


def main():
    p = argparse.ArgumentParser()
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--drop", action="append", default=[])
    p.add_argument("--replace", action="append", default=[], help="MEMBER=FILE")
    a = p.parse_args()
    replaced = dict(r.split("=", 1) for r in a.replace)
    with zipfile.ZipFile(a.src) as src:
        record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        lines = []
        with zipfile.ZipFile(a.dst, "w", compression=zipfile.ZIP_LZMA) as dst:
            for info in src.infolist():
                name = info.filename
                if name == record or any(fnmatch.fnmatch(name, d) for d in a.drop):
                    continue
                data = open(replaced[name], "rb").read() if name in replaced else src.read(name)
                member = zipfile.ZipInfo(name, date_time=info.date_time)
                member.external_attr = info.external_attr
                member.compress_type = zipfile.ZIP_LZMA
                dst.writestr(member, data)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                lines.append(f"{name},sha256={digest},{len(data)}")
            lines.append(f"{record},,")
            member = zipfile.ZipInfo(record, date_time=(2025, 1, 1, 0, 0, 0))
            member.compress_type = zipfile.ZIP_LZMA
            dst.writestr(member, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
