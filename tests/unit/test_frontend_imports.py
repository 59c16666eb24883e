"""The front-end must never import mlx: it runs on hosts with no accelerator."""

import subprocess
import sys


def test_importing_the_frontend_does_not_import_mlx() -> None:
    code = (
        "import sys\n"
        "import http_frontend, http_frontend.app, http_frontend.cli, http_frontend.openai.chat, protocol\n"
        "app = http_frontend.app.create_app('ipc:///tmp/none.sock')\n"
        "bad = sorted(m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_lm', 'mlx_vlm')))\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
