// A program that uses MPI itself: chorus must take MPI as the program initialised it, leave
// MPI_COMM_WORLD's error handler alone (it works on a private duplicate), and not finalise
// MPI; after dist::shutdown() the program's own MPI calls still work. Prints "user mpi ok".
#include <chorus/distributed.hpp>

#include <cstdio>

using namespace chorus;

int main() {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  int ok = 1;
  {
    auto& pg = dist::init();
    auto t = full<double>({4}, 1.0);
    pg.all_reduce(t);
    int world = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    ok &= t.to_vector()[3] == double(world);
    MPI_Errhandler handler;
    MPI_Comm_get_errhandler(MPI_COMM_WORLD, &handler);
    ok &= handler == MPI_ERRORS_ARE_FATAL;  // the program's (default) handler, untouched
    MPI_Errhandler_free(&handler);
    MPI_Errhandler mine;
    MPI_Comm_get_errhandler(pg.mpi_comm(), &mine);
    ok &= mine == MPI_ERRORS_RETURN;
    MPI_Errhandler_free(&mine);
    // The program's own collective while chorus's communication thread runs.
    int one = 1, sum = 0;
    MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    ok &= sum == world;
    dist::shutdown();
  }
  int finalized = 1;
  MPI_Finalized(&finalized);
  ok &= finalized == 0;  // chorus did not finalise the program's MPI
  int all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) std::printf(all ? "user mpi ok\n" : "user mpi FAILED\n");
  MPI_Finalize();
  return all ? 0 : 1;
}
