"""Stand-in for torch.optim."""


class AdamW:
    def __init__(self, params, lr=1e-3, weight_decay=0.0):
        self.params = list(params)

    def zero_grad(self, set_to_none=True):
        pass

    def step(self):
        pass
