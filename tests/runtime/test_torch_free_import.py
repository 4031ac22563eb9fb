"""The actor runtime imports no torch (issue 37): `import digenrl.actors` and the README's hello-world actor's
imports cost a fraction of a second, not the seconds torch takes; torch comes with the first tensor codec use."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, check=True)
    return set(out.stdout.split())


def test_importing_the_actor_runtime_imports_no_torch() -> None:
    modules = _modules_after("import digenrl.actors\nfrom digenrl.actors import Actor, ActorSystem, endpoint")
    assert "digenrl.actors.system" in modules
    assert "torch" not in modules


def test_the_hello_actor_example_imports_no_torch() -> None:
    # run_path under another name than __main__: its imports and class run, its main() does not
    modules = _modules_after(f"import runpy\nrunpy.run_path({str(ROOT / 'examples' / 'hello_actor.py')!r})")
    assert "torch" not in modules


def test_the_codec_still_comes_through_the_transport_package() -> None:
    modules = _modules_after("from digenrl.transport import encode, CodecOptions")
    assert "torch" in modules  # imported on first use, as the codec needs it
