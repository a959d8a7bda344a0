"""Integrations of kt-jit with other frameworks.

- :mod:`kt_jit.integrations.transformers`: run a Hugging Face transformers MoE model's routed
  experts on kt-jit (``offload_experts(model, method="BF16")``).

Submodules are imported on demand, so ``import kt_jit`` never imports transformers.
"""

__all__ = ["transformers"]
