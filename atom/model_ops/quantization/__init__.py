"""Weight quantization: what the checkpoint and the online config declare, and the
methods that give linear and expert modules their parameters and forward."""
