"""A saved KV segment's round trip, one implementation for every caller (the harness's children, the vLLM connector).

    layout, rope          how a KV cache is laid out; rotary settings and the key shift
    restore, gather       saved K/V into any layout at new positions (torch reference; the CUDA gather kernel)
    keys, record          where a payload is stored, and the versioned record that vouches for it
    catalog, digests      which object lands where in a staging buffer; the digests checked on arrival
    link, sources         the one adapter to the cache service (and its error mapping); where bytes come from
    load                  the load step: load -> verify -> private copy -> restore
    repair                the repair's entry point over a small model interface
    errors                every refusal of the package
"""
