# frozen_string_literal: true

require "test_helper"
require "securerandom"
require "neverblock/postgres"

# Fault injection on a pipelined pool, bounded for the suite: fibers send
# INSERTs through NeverBlock::Postgres.pool(pipeline: true) while another
# task keeps terminating the pool's backends (pg_terminate_backend). Every
# statement must end (a result or a connection error), and every lane must
# give its connection back, run after run.
#
# A longer form of the same run (2,000 INSERTs, and a server restart) once
# hung on a loaded machine: a lane's reader waited forever on a socket that
# libpq had closed under it, keeping its connection (pipeline_test.rb's
# test_a_connection_lost_under_a_sender_while_the_reader_waits_goes_back_to_the_pool
# makes that state on purpose; this run finds it by chance, most often on a
# busy machine). A run whose lanes keep a connection, or that does not end
# within RUN_TIMEOUT, fails and names the pool's state.
class PostgresPipelineFaultsTest < NeverBlockTest
  include NeverBlockTest::PostgresHelpers

  RUNS = 3
  INSERTS = 300 # per run
  FIBERS = 30
  POOL_SIZE = 4
  RUN_TIMEOUT = 60 # seconds; a run takes about 1-3 s
  # Seconds between two terminations, at most (a random pause up to this).
  TERMINATE_EVERY = 0.03

  neverblock_timeout (RUNS * RUN_TIMEOUT) + 30

  def test_inserts_through_a_pipelined_pool_whose_backends_keep_being_terminated_all_end_and_leave_no_connection_held
    table = create_table_with_serial
    RUNS.times do |run|
      name = unique_name("faults")
      db = client_from(pipeline: true, size: POOL_SIZE, timeout: 10, application_name: name, **pg_conninfo)
      outcomes, terminated, sent = insert_while_terminating(db, table, name, run)
      ok = outcomes.count(:ok)
      assert_equal sent, outcomes.size, "run #{run}: every INSERT ended"
      assert_equal [], outcomes.reject { |outcome| outcome == :ok || lost_connection?(outcome) },
                   "run #{run}: errors other than a lost connection"
      assert_operator terminated, :>, 0, "run #{run}: no backend was terminated (the run tested nothing)"
      assert_connections_given_back(db, run)
      assert_equal "1", select_one(db), "run #{run}: the pool works after the faults"
      assert_operator rows_of(table, run), :>=, ok, "run #{run}: an INSERT that succeeded is missing"
      db.close
    end
  end

  private

  def create_table_with_serial
    unique_name("t").tap do |table|
      with_admin { |admin| admin.exec("CREATE TABLE #{table} (id serial PRIMARY KEY, run integer, n integer)") }
      @tables << table
    end
  end

  # INSERTS statements from FIBERS fibers while a task terminates one of the
  # pool's backends every few milliseconds, and more (up to 10 times as many)
  # until one was terminated: on a busy machine the terminator's first turn
  # can come after the INSERTS have all ended. Fails if they take longer than
  # RUN_TIMEOUT seconds.
  # @return [Array(Array, Integer, Integer)] each INSERT's outcome (:ok or
  #   its error), how many backends were terminated, and how many INSERTs
  #   were sent
  def insert_while_terminating(db, table, name, run)
    terminated = 0
    terminator = NeverBlock.spawn { terminate_repeatedly(name) { terminated += 1 } }
    outcomes = []
    sent = 0
    begin
      NeverBlock.timeout(RUN_TIMEOUT) do
        FIBERS.times.map do
          NeverBlock.spawn do
            while sent < INSERTS || (terminated.zero? && sent < INSERTS * 10)
              outcomes << insert(db, table, run, sent += 1)
            end
          end
        end.each(&:value)
      end
    rescue NeverBlock::TimeoutError
      flunk "run #{run}: #{outcomes.size} of #{INSERTS} INSERTs ended within #{RUN_TIMEOUT} s; pool #{db.stats}"
    ensure
      terminator.cancel
      terminator.wait
    end
    [outcomes, terminated, sent]
  end

  def insert(db, table, run, value)
    db.exec_params("INSERT INTO #{table} (run, n) VALUES ($1, $2)", [run, value])
    :ok
  rescue PG::Error => e
    e
  end

  def rows_of(table, run)
    with_admin { |admin| Integer(admin.exec("SELECT count(*) FROM #{table} WHERE run = #{run}").getvalue(0, 0)) }
  end

  # Every statement has ended, so every lane must hand its connection back
  # within a turn or two of the loop (a reader left waiting would keep it).
  def assert_connections_given_back(db, run)
    deadline = now + 30
    sleep 0.01 until db.stats[:in_use].zero? || now > deadline
    assert_equal 0, db.stats[:in_use], "run #{run}: lanes kept their connections after every statement ended " \
                                       "(#{db.stats}); a reader still waiting on its socket?"
  end

  # SELECT 1, again when a backend terminated just before the terminator
  # stopped was still idle in the pool (its next statement fails, and it is
  # replaced).
  def select_one(db)
    attempts = 0
    begin
      db.exec("SELECT 1").getvalue(0, 0)
    rescue PG::Error => e
      raise unless lost_connection?(e) && (attempts += 1) < 3

      retry
    end
  end

  # What a statement on a lane that lost its connection may raise: its
  # outcome unknown (it was in flight), or the connection's own error when
  # it could not be sent (pg raises a plain PG::Error when a sync point
  # cannot be queued).
  def lost_connection?(error)
    [NeverBlock::Postgres::OutcomeUnknown, PG::ConnectionBad, PG::UnableToSend].any? { |kind| error.is_a?(kind) } ||
      error.instance_of?(PG::Error)
  end

  # Until cancelled: terminates one backend of the pool named `name`
  # (yields after each), then waits up to TERMINATE_EVERY seconds.
  def terminate_repeatedly(name)
    with_admin do |admin|
      loop do
        sleep(rand * TERMINATE_EVERY)
        terminated = admin.exec_params(<<~SQL, [name]).ntuples
          SELECT pg_terminate_backend(pid) FROM pg_stat_activity
          WHERE pid = (SELECT pid FROM pg_stat_activity WHERE application_name = $1 ORDER BY random() LIMIT 1)
        SQL
        yield if terminated.positive?
      end
    end
  end
end
