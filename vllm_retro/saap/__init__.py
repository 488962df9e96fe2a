"""SAAP calibration (``vllm-retro calibrate MODEL --out FILE``): train, once per model, the
key centroids and query classifiers the ``saap`` serving index routes with
(:mod:`vllm_retro.index.saap`, :mod:`vllm_retro.index.saap_model`).

- :mod:`~vllm_retro.saap.corpus`: the training text (by default the long descriptions of the
  Python distributions installed beside vllm-retro; ``--text`` for your own);
- :mod:`~vllm_retro.saap.record`: de-RoPEd queries and keys of every layer, from the
  Hugging Face model run on that text;
- :mod:`~vllm_retro.saap.train`: spherical k-means of the keys, the attention mass per bucket
  of long-range queries, the classifier trained on it, and its held-out quality;
- :mod:`~vllm_retro.saap.calibrate`: the command (settings, resumable work directory,
  progress, the file).

Nothing here is imported by the serving path.
"""
