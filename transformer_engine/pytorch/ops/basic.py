"""TE's basic fusible operations that megatron-core names: stand-ins (attention only here).

Each class is importable and subclassable; constructing one raises ``NotImplementedError``.
"""

from .op import BasicOperation


def _stand_in(name: str) -> type:
    return type(name, (BasicOperation,), {"te_name": f"transformer_engine.pytorch.ops.{name}", "__module__": __name__,
                                          "__doc__": f"Stand-in for transformer_engine.pytorch.ops.{name}."})


# Linear algebra, communication, activations and norms, as megatron's TEFusedMLP uses them.
BasicLinear = _stand_in("BasicLinear")
Bias = _stand_in("Bias")
AllGather = _stand_in("AllGather")
AllReduce = _stand_in("AllReduce")
ReduceScatter = _stand_in("ReduceScatter")
GELU = _stand_in("GELU")
GEGLU = _stand_in("GEGLU")
ReLU = _stand_in("ReLU")
ReGLU = _stand_in("ReGLU")
SiLU = _stand_in("SiLU")
SwiGLU = _stand_in("SwiGLU")
LayerNorm = _stand_in("LayerNorm")
RMSNorm = _stand_in("RMSNorm")
