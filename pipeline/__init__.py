"""Differentially private attention: three tasks (NoisyHead, pipeline/noisyhead/; DPFormer, pipeline/seqrec/;
DP language modelling, pipeline/lm/)
on shared machinery (this package's modules; docs/layout.md)."""

import uuid

from omegaconf import OmegaConf

# `${uid:}`: a short random id, the same everywhere in one composed config (cached, and copied
# into every cell of a sweep) but new in every `python -m pipeline`, so that two runs or two
# sweeps started in the same second never share a folder (conf/config.yaml, hydra.run.dir).
OmegaConf.register_new_resolver("uid", lambda: uuid.uuid4().hex[:8], use_cache=True, replace=True)
