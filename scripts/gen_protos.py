"""Generate the Python gRPC stubs from protos/ into mili/pb/<package>/v1/ (the one documented
command).

    python scripts/gen_protos.py           # regenerate the stubs in place
    python scripts/gen_protos.py --check   # exit 1 if the committed stubs differ from the protos

The stubs are committed so the package installs without grpcio-tools; CI runs --check so they can
never drift from the protos. protoc names a stub's module after its proto's path
(protos/mili/decode/v1/decode.proto -> mili.decode.v1.decode_pb2), which would put the stubs in
folders named like the services (mili/decode/ beside services/decode/); so they are written under
mili/pb/ and their imports of each other rewritten to match (as TGI does for its `pb` package).
The proto packages, and so the gRPC service names, stay `mili.<package>.v1`.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_ROOT = ROOT  # protos/mili/x/v1/y.proto -> mili/pb/x/v1/y_pb2.py
STUBS = Path("mili", "pb")
# `from mili.x.v1 import y_pb2` (protoc's spelling of a stub's import of another) -> mili.pb.x.v1
_IMPORT = re.compile(r"^(from|import) mili\.(\w+\.v1)\b", re.MULTILINE)
_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_INIT = '"""Generated from protos/ by scripts/gen_protos.py; do not edit."""\n'


def generate(out_root: Path) -> list[Path]:
    """Run protoc on every proto; return the files written, relative to out_root."""
    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    well_known = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(p.relative_to(PROTO_ROOT)) for p in protos),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed (see above)")
        for proto in protos:
            package_dir = proto.parent.relative_to(PROTO_ROOT)  # mili/x/v1
            target_dir = STUBS.joinpath(*package_dir.parts[1:])  # mili/pb/x/v1
            (out_root / target_dir).mkdir(parents=True, exist_ok=True)
            for suffix in _SUFFIXES:
                text = (Path(tmp) / package_dir / (proto.stem + suffix)).read_text()
                stub = target_dir / (proto.stem + suffix)
                (out_root / stub).write_text(_IMPORT.sub(r"\1 mili.pb.\2", text))
                written.append(stub)
            # Every generated folder (mili/pb, mili/pb/x, mili/pb/x/v1) must be a regular
            # package for setuptools.
            for depth in range(len(STUBS.parts), len(target_dir.parts) + 1):
                init = Path(*target_dir.parts[:depth]) / "__init__.py"
                (out_root / init).write_text(_INIT)
                written.append(init)
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
    print(f"wrote {len(written)} files under {STUBS}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
