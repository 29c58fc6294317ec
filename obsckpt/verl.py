"""``python -m obsckpt.verl``: verl's PPO trainer, checkpointing through obsckpt.

Takes the place of ``python -m verl.trainer.main_ppo`` with the same Hydra
overrides; the monitor's options come from ``+obsckpt.<option>=<value>``
overrides and the ``OBSCKPT_*`` variables (the variables win), e.g.::

    python -m obsckpt.verl trainer.default_local_dir=/ckpt ... \\
        +obsckpt.metrics_port=9400 +obsckpt.save_strategy=single_thread

See docs/integrations.md for the options and what the switch changes.
"""

from __future__ import annotations


def main() -> None:
    """Install obsckpt's hooks, then run verl's ``main_ppo`` on this process's arguments."""
    from obsckpt.integrations import verl_install

    verl_install.install()
    from verl.trainer.main_ppo import main as verl_main

    verl_main()


if __name__ == "__main__":
    main()
