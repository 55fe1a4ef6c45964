"""Coded communication: the coding engine, the collectives, and the DDP, FSDP2 and DeepSpeed adapters.

Users reach the adapters by their public paths, ``comm_codec.ddp``, ``comm_codec.fsdp``,
``comm_codec.deepspeed`` and ``comm_codec.collectives``.
"""
