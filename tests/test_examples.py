"""The examples in integrations/examples stay runnable: the TRL script's CPU smoke run trains with
GRPOKernelsTrainer; the verl launch script's overrides compose into a verl 0.9.1 config that
selects grpo_kernels (Hydra, as verl.trainer.main_ppo composes them; nothing is launched)."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest
from checkout import CHECKOUT, PYTHON_PREAMBLE
from parity_helpers import PINS, installed_version

EXAMPLES = CHECKOUT / "integrations" / "examples"


def require(dist: str) -> None:
    if installed_version(dist) != PINS[dist]:
        pytest.skip(f"needs {dist}=={PINS[dist]}, found {installed_version(dist)}")


def test_trl_example_smoke_run_trains_with_grpo_kernels():
    require("trl")
    code = PYTHON_PREAMBLE + (
        "import runpy\n"
        f"sys.argv = [{str(EXAMPLES / 'trl_grpo.py')!r}, '--smoke']\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "GRPOKernelsTrainer: trained 2 steps" in out.stdout, out.stdout[-2000:]


def verl_example_overrides(data_dir: str, model: str) -> list[str]:
    """The Hydra overrides of verl_grpo.sh, as its shell would pass them (DATA and MODEL filled in)."""
    script = (EXAMPLES / "verl_grpo.sh").read_text()
    command = script[script.index("python3 -m verl.trainer.main_ppo") : script.index('"$@"')]
    command = command.replace("\\\n", " ").replace("$DATA", data_dir).replace("$MODEL", model)
    return shlex.split(command)[3:]


def test_verl_example_overrides_select_grpo_kernels():
    require("verl")
    import os

    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(
            config_name="ppo_trainer", overrides=verl_example_overrides("/data/gsm8k", "Qwen/Qwen2.5-0.5B")
        )
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert actor.policy_loss.loss_mode == "gk_vanilla"
    assert config.actor_rollout_ref.model.use_fused_kernels is True
    assert config.actor_rollout_ref.model.fused_kernel_options.impl_backend == "triton"
    # Ray wants string environment values
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.GRPO_KERNELS_VERL_LINEAR_CE == "1"
    import grpo_kernels.integrations.verl as gk_verl
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    assert "gk_vanilla" in POLICY_LOSS_REGISTRY and "gk_vanilla" in gk_verl.registered_losses()
