"""The optimizer: AdamW with float32 master weights under mixed precision, the learning-rate
schedule and gradient clipping (adamw.py, with its compiled CPU kernel), and loss scaling for
16-bit training (loss_scale.py). Below the model: it sees parameters and gradients only."""
