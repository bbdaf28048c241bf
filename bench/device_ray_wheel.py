"""A trimmed Ray wheel (and the few packages Ray needs that the GPU machine lacks) for .whl/.

The GPU machine has no network and receives files only through a carry of at most 64 MiB, with
the working tree; Ray's wheel alone is 79 MB. Most of it is what `flashtrain rl` never loads:
the Java jars, the dashboard's browser build and Ray's libraries (RLlib, Data, Serve, Tune,
Train, LLM, AIR). This keeps the core (raylet, GCS, the driver and worker code, the runtime-env
agent) and rewrites RECORD for the files that stay, so pip installs it as any wheel.

    python -m bench.device_ray_wheel [--dest .whl] [--wheel ray-...whl] [--python 3.12]

Then on the GPU machine, with `.whl` carried:
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD

Prints one JSON object: the wheels written and their sizes.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# pyproject asks for ray>=2.40; this is the version the CPU machines run the RL tests with
RAY_VERSION = "2.60.0"
# folders of the wheel that nothing `import ray`, ray.init and actors load reaches (checked by
# grepping the kept code for module-level imports of them, and by a local cluster in a fresh
# environment); ray/_private/services.py starts Java workers only when ray/jars exists
STRIP = ("ray/jars/", "ray/dashboard/client/", "ray/rllib/", "ray/data/", "ray/serve/", "ray/tune/",
         "ray/train/", "ray/llm/", "ray/air/")
# Ray's Requires-Dist the GPU machine's image lacks (it has click, filelock, msgpack, packaging,
# protobuf, pyyaml, requests and attrs): jsonschema validates runtime_env plugin schemas
DEPS = ("jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0",
        "rpds-py==2026.9.1")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
CARRY_LIMIT = 64 * 2**20  # what one device call carries, the working tree included


def pip_download(names: list[str], python: str, dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + names, check=True)


def trim(src: Path, dest_dir: Path) -> dict:
    """Copy the wheel `src` into dest_dir without the STRIP folders; RECORD lists what stays."""
    out = dest_dir / src.name
    kept = dropped = dropped_bytes = 0
    with zipfile.ZipFile(src) as zin:
        names = zin.namelist()
        # the wheel's own RECORD sits in the top-level .dist-info (vendored packages carry theirs)
        records = [n for n in names if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            raise SystemExit(f"device_ray_wheel: {src.name} has {len(records)} top-level RECORD files, "
                             "expected 1")
        record = records[0]
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
            for info in zin.infolist():
                if info.filename == record:
                    continue
                if info.filename.startswith(STRIP):
                    dropped += 1
                    dropped_bytes += info.compress_size
                    continue
                zout.writestr(info, zin.read(info), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
                kept += 1
            # RECORD's rows are "path,sha256=...,size"; the kept files are byte for byte the
            # originals, so their rows (hashes included) stay valid
            rows = [row for row in zin.read(record).decode().splitlines()
                    if row and not row.split(",", 1)[0].startswith(STRIP)]
            zout.writestr(record, "\n".join(rows) + "\n")
    return {"file": out.name, "bytes": out.stat().st_size, "source_bytes": src.stat().st_size,
            "kept_files": kept, "dropped_files": dropped, "dropped_compressed_bytes": dropped_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dest", default=".whl", help="folder the wheels go into (default .whl)")
    ap.add_argument("--wheel", default=None, help=f"a downloaded ray-{RAY_VERSION} wheel to trim "
                    "(default: download it)")
    ap.add_argument("--python", default="3.12", help="the GPU machine's Python (default 3.12)")
    args = ap.parse_args()
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    tag = "cp" + args.python.replace(".", "")
    for old in dest.glob("ray-*.whl"):  # one version of each: two stop the whole install there
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        if args.wheel:
            src = Path(args.wheel)
            if not src.name.startswith(f"ray-{RAY_VERSION}-{tag}-"):
                raise SystemExit(f"device_ray_wheel: --wheel {src.name} is not ray {RAY_VERSION} for {tag}")
        else:
            pip_download([f"ray=={RAY_VERSION}"], args.python, Path(tmp))
            (src,) = Path(tmp).glob("ray-*.whl")
        ray = trim(src, dest)
    pip_download(list(DEPS), args.python, dest)
    wheels = {p.name: p.stat().st_size for p in sorted(dest.glob("*.whl"))}
    total = sum(wheels.values())
    result = {"ray": ray, "stripped": list(STRIP), "deps": list(DEPS), "wheels": wheels,
              "dest_bytes": total, "dest_mib": round(total / 2**20, 1)}
    print(json.dumps(result, indent=2))
    if total > CARRY_LIMIT - 6 * 2**20:  # the working tree travels in the same 64 MiB
        raise SystemExit(f"device_ray_wheel: {dest} holds {total / 2**20:.1f} MiB of wheels; with the "
                         f"working tree a device call carries at most {CARRY_LIMIT / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
