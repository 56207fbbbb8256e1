"""jaxllm inside reinforcement-learning libraries: :mod:`jaxllm.rl.tunix` (``pip install 'jaxllm[tunix]'``)."""
