/* The thread ids of the calling thread's OpenMP team, so the runtime can place each of its threads
 * on a CPU (engine/runtime/affinity.py). The team is the one every kernel here and torch's own
 * parallel ops run on: libgomp keeps one pool of threads per calling thread and reuses it.
 */
#define _GNU_SOURCE
#include <omp.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

/* tids[i] = the kernel thread id of team thread i, for a team of `nthreads` (thread 0 is the
 * caller); entries the runtime did not staff stay -1. Returns the team's size. */
int team_tids(int nthreads, int32_t *tids) {
    int size = 0;
    for (int i = 0; i < nthreads; i++) tids[i] = -1;
#pragma omp parallel num_threads(nthreads)
    {
        tids[omp_get_thread_num()] = (int32_t)syscall(SYS_gettid);
#pragma omp single
        size = omp_get_num_threads();
    }
    return size;
}
