"""Independent reference implementations, for checking KMesh against something that does not share its code.

- `addressing`: byte address of every K/V element of a `KVLayout`, from first principles (never its methods).
- `rotary`: RoPE frequencies, yarn's attention factor and a fresh rotation, from the published formulas
  as complex numbers in float64 (never kmesh.kv.rope's internals).

Used by the synthetic stage; meant for later stages (equivalence, group) too.
"""
