# frozen_string_literal: true

require "test_helper"
require "neverblock/active_record"
require "tmpdir"
require "fileutils"
require "minitest/mock"

# SQLite transactions of NeverBlock's fibers take turns
# (NeverBlock::ActiveRecord::SqliteWriteTurns): in order, and however a
# transaction ends, the next one gets the turn.
class ActiveRecordSqliteWriteTurnsTest < PlainTest
  Turns = NeverBlock::ActiveRecord::SqliteWriteTurns

  class Record < ActiveRecord::Base
    self.abstract_class = true
  end

  def setup
    @logger = NeverBlock.logger
    NeverBlock.logger = Logger.new(IO::NULL) # each test's new file is announced once (one test reads it)
    @dir = Dir.mktmpdir("nb-sqlite-turns")
    @path = File.join(@dir, "turns.sqlite3")
    Record.establish_connection(adapter: "sqlite3", database: @path, pool: 10, timeout: 5000)
    Record.connection_pool.with_connection do |connection|
      connection.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
    end
  end

  def teardown
    NeverBlock.logger = @logger
    Record.remove_connection
    FileUtils.rm_rf(@dir)
    super
  end

  def turn
    Turns.turn_for(File.expand_path(@path))
  end

  def write(body, hold: 0)
    Record.transaction do
      Record.connection_pool.with_connection do |connection|
        connection.execute("INSERT INTO notes (body) VALUES (#{connection.quote(body)})")
      end
      sleep hold if hold.positive?
      yield if block_given?
    end
  end

  def bodies
    Record.connection_pool.with_connection { |connection| connection.select_values("SELECT body FROM notes ORDER BY id") }
  end

  def test_a_process_says_once_that_a_files_transactions_take_turns
    log = capture_log do
      NeverBlock.run { 2.times { |index| write("w#{index}") } }
    end
    lines = log.lines.grep(/SQLite transactions on/)
    assert_equal 1, lines.size, log
    assert_includes lines.first, "#{File.expand_path(@path)} take turns in this process, first come first served"
  end

  def test_transactions_of_fibers_take_turns_in_the_order_they_began
    NeverBlock.run do
      NeverBlock.timeout(20) do
        NeverBlock.wait_all(Array.new(6) { |index| NeverBlock.spawn { write("w#{index}", hold: 0.05) } })
      end
    end
    assert_equal Array.new(6) { |index| "w#{index}" }, bodies
    assert_nil turn.holder, "the turn is free again"
  end

  def test_a_transaction_that_raises_gives_its_turn_back
    NeverBlock.run do
      NeverBlock.timeout(20) do
        failing = NeverBlock.spawn { write("rolled back", hold: 0.05) { raise ArgumentError, "no" } }
        following = NeverBlock.spawn { write("after") }
        assert_raises(ArgumentError) { failing.value }
        following.wait
      end
    end
    assert_equal ["after"], bodies
    assert_nil turn.holder
  end

  def test_a_cancelled_waiter_leaves_the_line_and_the_next_gets_the_turn
    NeverBlock.run do
      NeverBlock.timeout(20) do
        holder = NeverBlock.spawn { write("holder", hold: 0.3) }
        NeverBlock.sleep(0.05)
        cancelled = NeverBlock.spawn { write("cancelled") }
        after = NeverBlock.spawn { write("after") }
        NeverBlock.sleep(0.05)
        refute_nil turn.holder, "the holder has the turn"
        assert_equal 2, turn.waiting
        cancelled.cancel
        holder.wait
        after.wait
      end
    end
    assert_equal %w[holder after], bodies
    assert_nil turn.holder
  end

  # A request that writes twice queues its second transaction behind the
  # one that waited while it had the turn: the turn is handed over, not
  # put back for whoever asks first.
  def test_the_turn_is_handed_to_the_longest_waiting_not_taken_back
    NeverBlock.run do
      NeverBlock.timeout(20) do
        twice = NeverBlock.spawn do
          write("first", hold: 0.1)
          write("second")
        end
        NeverBlock.sleep(0.03)
        waiter = NeverBlock.spawn { write("waiter") }
        NeverBlock.wait_all([twice, waiter])
      end
    end
    assert_equal %w[first waiter second], bodies
    assert_nil turn.holder
  end

  # A waiter cancelled after the turn was handed to it, before it ran,
  # passes the turn on: the next waiter is not left waiting on a free turn.
  def test_a_waiter_cancelled_as_the_turn_is_handed_to_it_passes_it_on
    NeverBlock.run do
      NeverBlock.timeout(20) do
        cancelled = nil
        holder = NeverBlock.spawn do
          write("holder", hold: 0.1)
          cancelled.cancel # handed the turn by the commit above, not yet run
        end
        NeverBlock.sleep(0.03)
        cancelled = NeverBlock.spawn { write("cancelled") }
        NeverBlock.sleep(0.01)
        after = NeverBlock.spawn { write("after") }
        NeverBlock.timeout(3) { NeverBlock.wait_all([holder, after]) }
      end
    end
    assert_equal %w[holder after], bodies
    assert_nil turn.holder
  end

  # Cancelled while it holds the turn (a request_timeout, a client that
  # hung up): the rollback gives it back.
  def test_a_transaction_cancelled_while_it_holds_the_turn_gives_it_back
    NeverBlock.run do
      NeverBlock.timeout(20) do
        holder = NeverBlock.spawn { write("cancelled", hold: 5) }
        NeverBlock.sleep(0.1)
        holder.cancel
        write("after")
      end
    end
    assert_equal ["after"], bodies
    assert_nil turn.holder
  end

  # A transaction that waits on another fiber that needs the turn would
  # wait forever: the turn's wait ends with the error SQLite's own busy
  # timeout gives.
  def test_a_wait_for_the_turn_is_bounded
    error = nil
    NeverBlock.run do
      NeverBlock.timeout(20) do
        Turns.stub(:wait, 0.3) do
          holder = NeverBlock.spawn { write("holder", hold: 1) }
          NeverBlock.sleep(0.05)
          error = assert_raises(ActiveRecord::StatementTimeout) { write("waiter") }
          holder.wait
        end
      end
    end
    assert_match(/waited 0.3 s for the turn to write to .*turns.sqlite3/, error.message)
    assert_equal ["holder"], bodies
    assert_nil turn.holder
  end

  # Two pools on one file, both in one fiber's transactions: the inner one
  # does not wait for the outer one's turn (SQLite answers it, as before).
  def test_a_fiber_does_not_wait_for_its_own_turn
    other = Class.new(ActiveRecord::Base) do
      self.abstract_class = true
      def self.name = "OtherSqlitePool"
    end
    other.establish_connection(adapter: "sqlite3", database: @path, pool: 2, timeout: 200)
    NeverBlock.run do
      NeverBlock.timeout(20) do
        Record.transaction do
          Record.connection_pool.with_connection { |connection| connection.execute("INSERT INTO notes (body) VALUES ('outer')") }
          assert_raises(ActiveRecord::StatementTimeout, ActiveRecord::StatementInvalid) do
            other.transaction do
              other.connection_pool.with_connection { |connection| connection.execute("INSERT INTO notes (body) VALUES ('inner')") }
            end
          end
        end
      end
    end
    assert_equal ["outer"], bodies
    assert_nil turn.holder
  ensure
    other&.remove_connection
  end

  def test_a_bad_setting_is_a_clear_error
    Turns.remove_instance_variable(:@wait) if Turns.instance_variable_defined?(:@wait)
    previous = ENV.fetch(Turns::SWITCH, nil)
    ENV[Turns::SWITCH] = "soon"
    error = assert_raises(ArgumentError) { Turns.wait }
    assert_equal 'NEVERBLOCK_SQLITE_WRITE_TURNS must be off or a number of seconds > 0; got "soon"', error.message
  ensure
    previous.nil? ? ENV.delete(Turns::SWITCH) : ENV[Turns::SWITCH] = previous
    Turns.remove_instance_variable(:@wait) if Turns.instance_variable_defined?(:@wait)
  end

  def test_threads_and_in_memory_databases_take_no_turn
    inside = nil
    Thread.new { write("thread") { inside = turn.holder } }.join
    assert_nil inside, "a thread's transaction took the turn"
    Record.establish_connection(adapter: "sqlite3", database: ":memory:", pool: 2)
    NeverBlock.run do
      Record.connection_pool.with_connection { |connection| connection.execute("CREATE TABLE notes (body TEXT)") }
      Record.transaction do
        Record.connection_pool.with_connection { |connection| connection.execute("INSERT INTO notes VALUES ('m')") }
        inside = turn.holder
      end
    end
    assert_nil inside, "an in-memory database took a turn"
  end
end
