"""The progress bar (tqdm, on stderr, rank 0 only), or nothing."""

import sys


class Progress:
    """A per-epoch bar showing the running loss and throughput; a no-op when disabled."""

    def __init__(self, enabled=True):
        self.enabled = enabled
        self.bar = None

    def start_epoch(self, epoch, epochs, total, initial=0):
        self.close()
        if not self.enabled:
            return
        from tqdm import tqdm  # noqa: PLC0415

        tty = sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=initial, desc=f"epoch {epoch}/{epochs}",
                        unit="step", file=sys.stderr, leave=tty, dynamic_ncols=True,
                        mininterval=0.2 if tty else 5.0)

    def update(self, loss, images_per_sec, lr):
        if self.bar is not None:
            self.bar.set_postfix({"loss": f"{loss:.4f}", "img/s": f"{images_per_sec:,.0f}",
                                  "lr": f"{lr:.3g}"}, refresh=False)
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
