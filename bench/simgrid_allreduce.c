/* bench/simgrid_allreduce.c - the messages of one mpidl all-reduce, for SimGrid SMPI.
 *
 * Built and run by bench/simgrid.py (smpicc, smpirun on a platform described from a
 * mpidl machine file). Each algorithm sends what its module in mpidl/comm/ sends, as
 * point-to-point calls: ring.py (2(p-1) steps, chunk c of layout.even_split per step;
 * one message per chunk, which is mpidl's pattern while a chunk is within its 1 MiB
 * segment), recursive_doubling.py (fold, log2 rounds of the whole buffer, unfold),
 * tree.py (binomial reduce to 0, binomial broadcast), hierarchical.py (pieces to the
 * node's leader, a ring among the leaders per piece, pieces back); "mpi" is SMPI's own
 * MPI_Allreduce with the algorithm given by --cfg=smpi/allreduce. Payloads are not
 * reduced: only the network is simulated. Prints the seconds per call (below).
 *
 *   simgrid_allreduce ALGORITHM BYTES REPEATS RANKS_PER_NODE
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TAG 7

static void chunk(long n, int p, int c, long *lo, long *count) {
  long base = n / p, extra = n % p;
  *count = base + (c < extra);
  *lo = c * base + (c < extra ? c : extra);
}

static void ring(char *buf, char *tmp, long n, int item, MPI_Comm comm) {
  int rank, p;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &p);
  if (p == 1) return;
  int right = (rank + 1) % p, left = (rank - 1 + p) % p;
  for (int i = 0; i < 2 * (p - 1); i++) {
    long ds, ns, dr, nr;
    chunk(n, p, ((rank - 1 - i) % p + p) % p, &ds, &ns);
    chunk(n, p, ((rank - 2 - i) % p + p) % p, &dr, &nr);
    char *into = i < p - 1 ? tmp : buf + dr * item;  /* reduce-scatter half: scratch */
    MPI_Sendrecv(buf + ds * item, (int)(ns * item), MPI_BYTE, right, TAG,
                 into, (int)(nr * item), MPI_BYTE, left, TAG, comm, MPI_STATUS_IGNORE);
  }
}

static void recursive_doubling(char *buf, char *tmp, long nbytes, int rank, int p) {
  int q = 1;
  while (q * 2 <= p) q *= 2;
  int rem = p - q, v;
  if (rank < 2 * rem) {
    if (rank % 2 == 0) {  /* folded out: hand over, take the result back */
      MPI_Send(buf, (int)nbytes, MPI_BYTE, rank + 1, TAG, MPI_COMM_WORLD);
      MPI_Recv(buf, (int)nbytes, MPI_BYTE, rank + 1, TAG, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      return;
    }
    MPI_Recv(tmp, (int)nbytes, MPI_BYTE, rank - 1, TAG, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    v = rank / 2;
  } else {
    v = rank - rem;
  }
  for (int mask = 1; mask < q; mask <<= 1) {
    int w = v ^ mask, partner = w < rem ? 2 * w + 1 : w + rem;
    MPI_Sendrecv(buf, (int)nbytes, MPI_BYTE, partner, TAG, tmp, (int)nbytes, MPI_BYTE,
                 partner, TAG, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  }
  if (rank < 2 * rem) MPI_Send(buf, (int)nbytes, MPI_BYTE, rank - 1, TAG, MPI_COMM_WORLD);
}

static void tree(char *buf, char *tmp, long nbytes, int rank, int p) {
  for (int mask = 1; mask < p; mask <<= 1) {  /* binomial reduce to rank 0 */
    if (rank & mask) {
      MPI_Send(buf, (int)nbytes, MPI_BYTE, rank - mask, TAG, MPI_COMM_WORLD);
      break;
    }
    if (rank + mask < p)
      MPI_Recv(tmp, (int)nbytes, MPI_BYTE, rank + mask, TAG, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  }
  int low = rank ? (rank & -rank) : 1, top = 1;  /* binomial broadcast from rank 0 */
  while (top < p) top <<= 1;
  if (rank)
    MPI_Recv(buf, (int)nbytes, MPI_BYTE, rank - low, TAG, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  for (int m = rank ? low >> 1 : top >> 1; m >= 1; m >>= 1)
    if (rank + m < p) MPI_Send(buf, (int)nbytes, MPI_BYTE, rank + m, TAG, MPI_COMM_WORLD);
}

/* hierarchical.py: pieces of max(segment, n / 16) elements */
static void hierarchical(char *buf, char *tmp, long n, int item, int rank, int p, int per_node,
                         MPI_Comm leaders) {
  long seg = (1L << 20) / item, size = (n + 15) / 16;
  if (size < seg) size = seg;
  int pieces = (int)((n + size - 1) / size), leader = rank / per_node * per_node;
  int members = (leader + per_node <= p ? per_node : p - leader) - 1;
  MPI_Request *reqs = malloc(sizeof(MPI_Request) * 2 * (pieces * (members + 1) + 1));
  int nreq = 0;
  if (rank != leader) {
    for (int k = 0; k < pieces; k++) {
      long lo = k * size, hi = lo + size < n ? lo + size : n;
      MPI_Isend(buf + lo * item, (int)((hi - lo) * item), MPI_BYTE, leader, TAG,
                MPI_COMM_WORLD, &reqs[nreq++]);
    }
    for (int k = 0; k < pieces; k++) {
      long lo = k * size, hi = lo + size < n ? lo + size : n;
      MPI_Irecv(tmp + lo * item, (int)((hi - lo) * item), MPI_BYTE, leader, TAG,
                MPI_COMM_WORLD, &reqs[nreq++]);
    }
  } else {  /* as the module: piece k + 1's receives are posted before piece k's ring */
    MPI_Request *got = malloc(sizeof(MPI_Request) * 2 * (members + 1));
    for (int k = 0; k < pieces; k++) {
      for (int j = k ? 1 : 0; j < 2 && k + j < pieces; j++) {
        long lo = (k + j) * size, hi = lo + size < n ? lo + size : n;
        for (int m = 1; m <= members; m++)
          MPI_Irecv(tmp + lo * item, (int)((hi - lo) * item), MPI_BYTE, leader + m, TAG,
                    MPI_COMM_WORLD, &got[((k + j) % 2) * (members + 1) + m]);
      }
      long lo = k * size, hi = lo + size < n ? lo + size : n;
      for (int m = 1; m <= members; m++)
        MPI_Wait(&got[(k % 2) * (members + 1) + m], MPI_STATUS_IGNORE);
      ring(buf + lo * item, tmp + lo * item, hi - lo, item, leaders);
      for (int m = 1; m <= members; m++)
        MPI_Isend(buf + lo * item, (int)((hi - lo) * item), MPI_BYTE, leader + m, TAG,
                  MPI_COMM_WORLD, &reqs[nreq++]);
    }
    free(got);
  }
  MPI_Waitall(nreq, reqs, MPI_STATUSES_IGNORE);
  free(reqs);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, p;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  if (argc != 5) {
    if (rank == 0) fprintf(stderr, "usage: %s ALGORITHM BYTES REPEATS RANKS_PER_NODE\n", argv[0]);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const char *alg = argv[1];
  long nbytes = atol(argv[2]);
  int reps = atoi(argv[3]), per_node = atoi(argv[4]);
  MPI_Comm leaders;
  MPI_Comm_split(MPI_COMM_WORLD, rank % per_node ? MPI_UNDEFINED : 0, rank, &leaders);
  char *buf = SMPI_SHARED_MALLOC(nbytes), *tmp = SMPI_SHARED_MALLOC(nbytes);
  MPI_Barrier(MPI_COMM_WORLD);
  double t0 = MPI_Wtime();
  for (int k = 0; k < reps; k++) {
    if (!strcmp(alg, "ring")) ring(buf, tmp, nbytes / 4, 4, MPI_COMM_WORLD);
    else if (!strcmp(alg, "recursive_doubling")) recursive_doubling(buf, tmp, nbytes, rank, p);
    else if (!strcmp(alg, "tree")) tree(buf, tmp, nbytes, rank, p);
    else if (!strcmp(alg, "hierarchical"))
      hierarchical(buf, tmp, nbytes / 4, 4, rank, p, per_node, leaders);
    else MPI_Allreduce(buf, tmp, (int)(nbytes / 4), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  }
  /* SMPI's clock is one simulated clock for every rank: a call lasts from the moment
     the last rank enters it (ranks leave the barrier at different times) to the moment
     the last rank leaves it */
  double t[2] = {t0, MPI_Wtime()}, last[2];
  MPI_Reduce(t, last, 2, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
  if (rank == 0) printf("TIME %.9g\n", (last[1] - last[0]) / reps);
  SMPI_SHARED_FREE(buf);
  SMPI_SHARED_FREE(tmp);
  if (leaders != MPI_COMM_NULL) MPI_Comm_free(&leaders);
  MPI_Finalize();
  return 0;
}
