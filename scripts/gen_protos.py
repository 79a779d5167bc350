"""Generate the Python gRPC stubs from protos/ into mili/<package>/v1/ (the one documented command).

    python scripts/gen_protos.py           # regenerate the stubs in place
    python scripts/gen_protos.py --check   # exit 1 if the committed stubs differ from the protos

The stubs are committed so the package installs without grpcio-tools; CI runs --check so they can
never drift from the protos.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_ROOT = ROOT  # protos/mili/x/v1/y.proto -> mili/x/v1/y_pb2.py (the import path follows the file)
_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_INIT = '"""Generated from protos/ by scripts/gen_protos.py; do not edit."""\n'


def generate(out_root: Path) -> list[Path]:
    """Run protoc on every proto; return the files written, relative to out_root."""
    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    well_known = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(p.relative_to(PROTO_ROOT)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed (see above)")
    written = []
    for proto in protos:
        package_dir = proto.parent.relative_to(PROTO_ROOT)
        # Every generated folder (mili/x, mili/x/v1) must be a regular package for setuptools.
        for depth in range(2, len(package_dir.parts) + 1):
            init = Path(*package_dir.parts[:depth]) / "__init__.py"
            (out_root / init).write_text(_INIT)
            written.append(init)
        written += [package_dir / (proto.stem + s) for s in _SUFFIXES]
    return sorted(set(written))


def check() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        expected = generate(Path(tmp))
        stale = [f for f in expected if not (OUT_ROOT / f).exists()]
        stale += [
            f for f in expected if f not in stale and not filecmp.cmp(Path(tmp) / f, OUT_ROOT / f)
        ]
    if stale:
        print("generated stubs are out of date with protos/:", file=sys.stderr)
        for f in stale:
            print(f"  {f}", file=sys.stderr)
        print("run: python scripts/gen_protos.py", file=sys.stderr)
        return 1
    print(f"stubs in sync with protos/ ({len(expected)} files)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the stubs are stale")
    args = parser.parse_args()
    if args.check:
        return check()
    written = generate(OUT_ROOT)
    print(f"wrote {len(written)} files under mili/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
