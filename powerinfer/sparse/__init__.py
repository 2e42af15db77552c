"""Sparse computation, in one home.

- Weights: FFN tensors of the file, dense or as one record per neuron (ffn.py, neurons.py);
  linears stored by rows or by input channel (storage.py, columns.py; payoff.py: where columns pay).
- Selection, which neurons or input channels a row computes (select.py): all, the activation
  threshold ("oracle"), the predictor (predictor.py), or per-channel thresholds of the input
  (sites.py).
- Execution: native CPU operators for one row, dense GEMMs for many (ffn.py), the hot/cold split
  between an accelerator and the CPU (hybrid.py).
- Calibration: the activation profiler and predictor training for neuron sparsity (profiler.py,
  predictor_training.py, folders.py); TEAL-style sites, thresholds and their allocation for input
  sparsity (calibrate.py, allocate.py, sparsify.py).
"""
