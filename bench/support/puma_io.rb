# Puma configuration of Puma 8's IO mode (bench/server.rb's puma_io,
# bench/rails.rb's puma_io): Puma's default threads (0:5) for requests that
# use the CPU, plus up to NB_BENCH_PUMA_IO_THREADS more for requests that
# call env["puma.mark_as_io_bound"] (the apps' sleeping actions do, first
# thing). Set to the connections or concurrency of the run, so that every
# request in flight can be an IO thread: the most a Puma user would give an
# IO-bound app. The app's database pool is sized to the threads' sum.
max_io_threads Integer(ENV.fetch("NB_BENCH_PUMA_IO_THREADS"))
