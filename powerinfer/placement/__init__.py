"""Hot/cold neuron placement: the cost model, the integer program, PowerInfer's GPU index file."""
