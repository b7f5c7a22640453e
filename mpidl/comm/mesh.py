"""``Mesh``: named process groups (dp, pp, tp axes, and roles) over a world of ranks.

A rank's place: the first world ranks may take roles (``roles={"server": 2}``: world
ranks 0 and 1 are servers); the others are ``"trainer"`` ranks laid out on a grid of
axes ``dp x pp x tp`` in ``order`` (outermost first; the innermost axis varies fastest
over consecutive trainer ranks, so with the default order the tp groups are consecutive
ranks, the usual choice because tensor parallelism talks most). Each axis group of a
rank is the set of trainers that share all its other coordinates.

Why ``Comm.Split`` and not group-by-group creation: frameworks that create a
communicator per group with ``MPI_Comm_create``-style calls require every rank to create
every group, including the groups it is not in, in exactly the same order; one rank
that skips or reorders a group hangs the job. Here each grouping is ONE ``Split`` over
the world that every rank calls with the color of its own group (``MPI.UNDEFINED`` when
it has none): the roles split first, then one split per axis in ``order``. A rank never
names another rank's groups, so there is no per-group sequence to get wrong: the number
and order of collective calls is the same on every rank by construction (the mesh's
arguments are the same everywhere; a rank's own coordinates only change its colors).

Every group is a full ``Communicator`` (all algorithms, non-blocking forms, consistency
check, point-to-point, counters) sharing the world's timeline and ``auto`` tables. Its
progress thread starts only when it first runs a non-blocking collective, so a rank of a
3-axis mesh runs threads only for the groups that use them (typically data-parallel).
"""

from mpi4py import MPI

from .communicator import Communicator

AXES = ("pp", "dp", "tp")
TRAINER = "trainer"


class Mesh:
    """Process groups over ``world`` (an mpidl ``Communicator``, an mpi4py communicator
    or None for ``MPI.COMM_WORLD``). Collective over the world.

    ``dp``/``pp``/``tp``: axis sizes (``dp=None``: the trainer ranks left over);
    ``order``: the axes, outermost first; ``roles``: ordered ``{role: count}`` taking the
    first world ranks; ``check``/``timeline``: for the world communicator when the mesh
    creates it (groups share the world's). Axes of size 1 are groups too.
    """

    def __init__(self, world=None, *, dp=None, pp=1, tp=1, order=AXES, roles=None,
                 check="digest", timeline=None):
        if isinstance(world, Communicator):
            self.world, self._owns_world = world, False
        else:
            mpi_comm = MPI.COMM_WORLD if world is None else world
            if not isinstance(mpi_comm, MPI.Comm):
                raise TypeError(f"Mesh: world must be an mpidl Communicator, an mpi4py "
                                f"communicator or None, got {type(world).__name__}")
            self.world = Communicator(mpi_comm, check=check, timeline=timeline,
                                      label="world")
            self._owns_world = True
        try:
            self._build(dp, pp, tp, tuple(order), dict(roles or {}))
        except BaseException:
            if self._owns_world:
                self.world.close()
            raise

    # ------------------------------------------------------------------ layout
    def _build(self, dp, pp, tp, order, roles):
        world = self.world
        n, me = world.size, world.rank
        if sorted(order) != sorted(AXES):
            raise ValueError(f"Mesh: order={order!r} must name each of {', '.join(AXES)} "
                             "once (outermost first)")
        for role, count in roles.items():
            if role in AXES or role in (TRAINER, "world") or not isinstance(role, str):
                raise ValueError(f"Mesh: role name {role!r} is reserved or not a string: "
                                 f"pick another (not {', '.join(AXES + (TRAINER, 'world'))})")
            if not isinstance(count, int) or count < 1:
                raise ValueError(f"Mesh: roles[{role!r}]={count!r}: give a positive number "
                                 "of ranks")
        n_roles = sum(roles.values())
        trainers = n - n_roles
        sizes = {"dp": dp, "pp": pp, "tp": tp}
        for axis, v in sizes.items():
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"Mesh: {axis}={v!r}: axis sizes are positive integers")
        fixed = 1
        for axis in AXES:
            if axis != "dp" or dp is not None:
                fixed *= sizes[axis]
        role_txt = (f" (world {n} minus roles {roles})" if roles else "")
        if trainers < 1:
            raise ValueError(f"Mesh: roles {roles} take {n_roles} of the {n} world ranks, "
                             "leaving no trainer: launch more ranks or give fewer to roles")
        if dp is None:
            if trainers % fixed:
                raise ValueError(f"Mesh: pp={pp} x tp={tp} = {fixed} does not divide the "
                                 f"{trainers} trainer ranks{role_txt}: choose pp and tp "
                                 f"whose product divides {trainers}")
            sizes["dp"] = trainers // fixed
        elif fixed != trainers:
            raise ValueError(f"Mesh: dp={dp} x pp={pp} x tp={tp} = {fixed} ranks, but there "
                             f"are {trainers} trainer ranks{role_txt}: choose sizes whose "
                             f"product is {trainers}, or dp=None for the rest")
        self._sizes = sizes
        self.order = order
        self.roles = roles

        # My role: the first ranks in the order roles are given.
        self.role, lo = TRAINER, 0
        role_index = len(roles)
        for i, (role, count) in enumerate(roles.items()):
            if lo <= me < lo + count:
                self.role, role_index = role, i
            lo += count
        self._coords = {}
        if self.role == TRAINER:
            t = me - n_roles
            for axis in reversed(order):  # innermost varies fastest
                self._coords[axis] = t % sizes[axis]
                t //= sizes[axis]

        # One Split per grouping, called by every world rank in the same order.
        self._groups = {}
        if roles:
            self._groups[self.role] = world.split(role_index, me, label=self.role)
        else:
            self._groups[TRAINER] = world
        for axis in order:
            if self.role == TRAINER:
                color = 0
                for other in order:
                    if other != axis:
                        color = color * sizes[other] + self._coords[other]
                key = self._coords[axis]
            else:
                color, key = None, 0
            self._groups[axis] = world.split(color, key, label=axis)
        self._ranks = {}

    # ------------------------------------------------------------------ queries
    def group(self, name):
        """The ``Communicator`` of my group along axis ``name`` (None on ranks without
        that axis, e.g. servers), or of my role ``name`` (None if I have another role)."""
        if name == "world":
            return self.world
        if name in AXES:
            return self._groups.get(name)
        if name != TRAINER and name not in self.roles:
            raise ValueError(f"Mesh: no axis or role named {name!r}: axes are "
                             f"{', '.join(AXES)}; roles are "
                             f"{', '.join(list(self.roles) + [TRAINER])}")
        return self._groups.get(name) if name == self.role else None

    def coord(self, axis):
        """My coordinate along ``axis`` (my rank in that group); None off the grid."""
        self._axis(axis)
        return self._coords.get(axis)

    def size(self, axis):
        """The size of ``axis`` (the same on every rank)."""
        self._axis(axis)
        return self._sizes[axis]

    def ranks(self, name):
        """World ranks of my group ``name`` (axis or role), in group-rank order."""
        if name not in self._ranks:
            g = self.group(name)
            if g is None:
                self._ranks[name] = None
            else:
                mine = g.mpi.Get_group()
                theirs = self.world.mpi.Get_group()
                self._ranks[name] = tuple(MPI.Group.Translate_ranks(
                    mine, list(range(g.size)), theirs))
                mine.Free()
                theirs.Free()
        return self._ranks[name]

    @property
    def shape(self):
        """``{axis: size}`` in ``order``."""
        return {axis: self._sizes[axis] for axis in self.order}

    def counters(self):
        """``{group name: counters}`` for the world and every group this rank is in."""
        out = {"world": self.world.counters()}
        for name, g in self._groups.items():
            if g is not None and g is not self.world:
                out[name] = g.counters()
        return out

    def reset_counters(self):
        for g in {id(g): g for g in [self.world, *self._groups.values()] if g}.values():
            g.reset_counters()

    def close(self):
        """Close the groups this mesh made (and the world if it made it). Collective."""
        for name in list(self.order)[::-1] + [n for n in self._groups if n not in AXES]:
            g = self._groups.pop(name, None)
            if g is not None and g is not self.world:
                g.close()
        if self._owns_world:
            self.world.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _axis(self, axis):
        if axis not in AXES:
            raise ValueError(f"Mesh: no axis named {axis!r}: axes are {', '.join(AXES)}")

    def __repr__(self):
        where = (", ".join(f"{a}={self._coords[a]}/{self._sizes[a]}" for a in self.order)
                 if self._coords else "off the grid")
        return f"<Mesh world rank {self.world.rank}/{self.world.size} {self.role}: {where}>"
