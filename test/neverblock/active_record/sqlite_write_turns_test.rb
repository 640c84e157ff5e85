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
    @dir = Dir.mktmpdir("nb-sqlite-turns")
    @path = File.join(@dir, "turns.sqlite3")
    Record.establish_connection(adapter: "sqlite3", database: @path, pool: 10, timeout: 5000)
    Record.connection_pool.with_connection do |connection|
      connection.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
    end
  end

  def teardown
    Record.remove_connection
    FileUtils.rm_rf(@dir)
    super
  end

  def turn
    Turns.turn_for(File.expand_path(@path)).queue
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

  def test_transactions_of_fibers_take_turns_in_the_order_they_began
    NeverBlock.run do
      NeverBlock.timeout(20) do
        NeverBlock.wait_all(Array.new(6) { |index| NeverBlock.spawn { write("w#{index}", hold: 0.05) } })
      end
    end
    assert_equal Array.new(6) { |index| "w#{index}" }, bodies
    assert_equal 1, turn.size, "the turn is free again"
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
    assert_equal 1, turn.size
  end

  def test_a_cancelled_waiter_leaves_the_line_and_the_next_gets_the_turn
    NeverBlock.run do
      NeverBlock.timeout(20) do
        holder = NeverBlock.spawn { write("holder", hold: 0.3) }
        NeverBlock.sleep(0.05)
        cancelled = NeverBlock.spawn { write("cancelled") }
        after = NeverBlock.spawn { write("after") }
        NeverBlock.sleep(0.05)
        assert_equal 0, turn.size, "the holder has the turn"
        cancelled.cancel
        holder.wait
        after.wait
      end
    end
    assert_equal %w[holder after], bodies
    assert_equal 1, turn.size
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
    assert_equal 1, turn.size
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
    assert_equal 1, turn.size
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
    assert_equal 1, turn.size
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
    Thread.new { write("thread") { inside = turn.size } }.join
    assert_equal 1, inside, "a thread's transaction took the turn"
    Record.establish_connection(adapter: "sqlite3", database: ":memory:", pool: 2)
    NeverBlock.run do
      Record.connection_pool.with_connection { |connection| connection.execute("CREATE TABLE notes (body TEXT)") }
      Record.transaction do
        Record.connection_pool.with_connection { |connection| connection.execute("INSERT INTO notes VALUES ('m')") }
        inside = turn.size
      end
    end
    assert_equal 1, inside, "an in-memory database took a turn"
  end
end
