"""The RNG tracker of paper Appendix B.2: dropout outside tensor-parallel regions (embeddings,
residual branches) draws from a stream seeded the same on every TP rank, so replicated
activations get identical masks; dropout inside TP regions (attention probabilities of this
rank's heads) draws from a stream seeded per TP rank (Megatron: seed + 2718 + tp_rank)."""

DEFAULT = "default"
MODEL_PARALLEL = "model-parallel"
MODEL_PARALLEL_SEED_OFFSET = 2718


class RNGTracker:
    def __init__(self, seed, tp_rank, xp):
        self.streams = {
            DEFAULT: xp.random.default_rng(seed),
            MODEL_PARALLEL: xp.random.default_rng(seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank),
        }

    def __getitem__(self, name):
        return self.streams[name]

    def get_states(self):
        """{stream: generator state}, to save in a checkpoint."""
        return {name: g.bit_generator.state for name, g in self.streams.items()}

    def set_states(self, states):
        for name, state in states.items():
            self.streams[name].bit_generator.state = state
