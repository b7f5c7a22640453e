"""mpidl: a pure-MPI toolkit for training neural networks on many processes."""

__version__ = "0.1.0"
