"""omlx: a declarative, config-driven LLM inference appliance on MLX.

omlx never uses PyTorch, but mlx-lm imports transformers, which imports all of PyTorch
(and with it torch._dynamo, sympy and scikit-learn) whenever it is installed: 9-15 s
before a server could log its first line on the H200 machine (BENCHMARKS.md, "GPU").
Marking the module absent makes transformers see no PyTorch (its check is
`importlib.util.find_spec`, which answers None for a None entry); set
OMLX_ALLOW_TORCH=1 to import it anyway.
"""

import os
import sys

if os.environ.get("OMLX_ALLOW_TORCH") != "1":
    sys.modules.setdefault("torch", None)
