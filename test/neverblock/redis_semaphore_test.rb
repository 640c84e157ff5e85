# frozen_string_literal: true

require_relative "../test_helper"
require "securerandom"
require "tmpdir"
require "fileutils"
require "rbconfig"
require "tempfile"
require "neverblock/redis_semaphore"
require_relative "../support/counting_upstream"
require_relative "../support/own_redis"

# NeverBlock::RedisSemaphore against a real Redis (bin/test's): a bound
# shared by several processes, counted by the upstream; leases that end
# when a holder is killed; FIFO across processes; timeouts and
# cancellation that leave nothing behind; the rate form; and Redis down
# (fail closed, or run unbounded) or restarted without its data.
class RedisSemaphoreTest < NeverBlockTest
  include NeverBlockTest::Databases
  include OwnRedis
  neverblock_timeout 60

  CHILD = File.expand_path("../fixtures/redis_semaphore_child.rb", __dir__)

  def setup
    @name = "test-#{name}-#{SecureRandom.hex(4)}"
    @semaphores = []
    @children = []
  end

  def teardown
    @children.each do |child|
      Process.kill(:KILL, child[:pid])
    rescue Errno::ESRCH
      nil
    ensure
      begin
        Process.wait(child[:pid])
      rescue Errno::ECHILD
        nil
      end
      child[:out].close
      child[:err].close!
    end
    @semaphores.each(&:close)
    super
  end

  # A semaphore of this test's name; several stand for several processes
  # (each has its own line and connections).
  def semaphore(limit = 1, url: redis_url, lease: 1, **options)
    NeverBlock::RedisSemaphore.new(@name, limit, url: url, lease: lease, **options).tap { |s| @semaphores << s }
  end

  def test_the_options_are_checked
    assert_raises(ArgumentError) { semaphore(0) }
    assert_raises(ArgumentError) { semaphore(1, per: 0) }
    assert_raises(ArgumentError) { semaphore(1, unavailable: :open) }
    assert_raises(ArgumentError) { NeverBlock::RedisSemaphore.new("", 1) }
    assert_raises(ArgumentError) { semaphore.acquire }
  end

  def test_processes_never_call_the_upstream_more_than_the_limit_at_once
    upstream = CountingUpstream.new(hold: 0.05)
    env = { "NB_MODE" => "calls", "NB_LIMIT" => "3", "NB_FIBERS" => "4", "NB_CALLS" => "5",
            "NB_UPSTREAM_PORT" => upstream.port.to_s }
    children = Array.new(3) { start_child(env) }
    children.each { |child| assert_equal "done 20\n", child[:out].gets }
    children.each { |child| assert_empty child[:err].read, "a child warned" }
    assert_equal 60, upstream.calls
    assert_operator upstream.most, :<=, 3, "the upstream served more calls at once than the limit"
    assert_operator upstream.most, :>=, 2, "the calls were serialized"
    assert_equal 3, semaphore(3).available
    assert_equal 0, semaphore(3).waiting
  ensure
    upstream&.close
  end

  def test_a_lease_is_renewed_while_its_holder_lives_and_ends_when_it_is_killed
    # A 2 s lease, renewed every 0.67 s: a child held up by a loaded
    # machine has 1.3 s to spare.
    holder = start_child({ "NB_MODE" => "hold", "NB_LEASE" => "2" })
    assert_equal "held\n", holder[:out].gets
    waiter = semaphore
    # Three leases long: only renewals keep the holder's permit.
    assert_raises(NeverBlock::SemaphoreTimeout) { waiter.acquire(timeout: 6) { flunk "two holders" } }
    assert_equal 0, waiter.waiting, "a timed-out waiter left its ticket"

    task = NeverBlock.spawn { waiter.acquire { :acquired } }
    eventually { waiter.waiting == 1 }
    Process.kill(:KILL, holder[:pid])
    assert_equal :acquired, task.value # within a lease (2 s) of the kill
    assert_equal 1, waiter.available
  end

  def test_waiters_of_different_processes_acquire_in_arrival_order
    holder = semaphore
    release = Queue.new
    order = []
    held = NeverBlock.spawn { holder.acquire { release.pop } }
    eventually { holder.available.zero? }
    waiters = Array.new(4) do |i|
      process = semaphore
      task = NeverBlock.spawn { process.acquire { order << i } }
      eventually { holder.waiting == i + 1 }
      task
    end
    release << true
    NeverBlock.wait_all([held, *waiters])
    assert_equal [0, 1, 2, 3], order
  end

  # A waiter looks again on its own only every lease / 3 (5 s here): it
  # acquires long before that because the permit given back wakes it.
  def test_a_permit_given_back_wakes_the_next_waiter_at_once
    holder = semaphore(lease: 15)
    waiter = semaphore(lease: 15)
    waiter.acquire { :past_the_fence }
    release = Queue.new
    held = NeverBlock.spawn { holder.acquire { release.pop } }
    eventually { holder.available.zero? }
    task = NeverBlock.spawn { waiter.acquire { now } }
    eventually { holder.waiting == 1 }
    released_at = now
    release << true
    held.wait
    assert_operator task.value - released_at, :<, 2.5, "the waiter was not woken: it waited for its own next look"
  end

  def test_a_dead_waiters_place_in_line_ends_with_its_lease
    holder = semaphore
    release = Queue.new
    held = NeverBlock.spawn { holder.acquire { release.pop } }
    eventually { holder.available.zero? }
    dead = start_child({ "NB_MODE" => "wait" })
    assert_equal "waiting\n", dead[:out].gets
    Process.kill(:KILL, dead[:pid])
    task = NeverBlock.spawn { semaphore.acquire { :acquired } }
    eventually { holder.waiting == 2 }
    release << true
    held.wait
    assert_equal :acquired, task.value # behind the dead one's place, until it ended
    assert_equal 0, holder.waiting
  end

  def test_a_cancelled_waiter_leaves_the_line_and_a_cancelled_holder_gives_its_permit_back_at_once
    limited = semaphore
    holder = NeverBlock.spawn { limited.acquire { sleep } }
    eventually { limited.available.zero? }
    waiter = NeverBlock.spawn { limited.acquire { flunk "a cancelled waiter ran" } }
    eventually { limited.waiting == 1 }
    waiter.cancel.wait
    assert_equal 0, limited.waiting
    holder.cancel.wait
    assert_equal 1, limited.available # given back, not left to its lease
    assert_raises(RuntimeError) { limited.acquire { raise "boom" } }
    assert_equal 1, limited.available
  end

  def test_a_timed_out_waiter_says_so_and_leaves_nothing_behind
    limited = semaphore(2)
    release = Queue.new
    holders = Array.new(2) { NeverBlock.spawn { semaphore(2).acquire { release.pop } } }
    eventually { limited.available.zero? }
    error = assert_raises(NeverBlock::SemaphoreTimeout) { limited.acquire(timeout: 0.1) { flunk "ran" } }
    assert_kind_of NeverBlock::Error, error
    assert_match(/no permit of #{@name} \(RedisSemaphore, limit 2\) came within 0.1 s/, error.message)
    assert_equal 0, limited.waiting
    2.times { release << true }
    NeverBlock.wait_all(holders)
    assert_equal 2, limited.available
  end

  # A waiter that times out while its ask is on the way to Redis: the ask
  # arrives after the waiter gave its ticket up, and is refused.
  def test_an_ask_that_arrives_after_its_ticket_was_given_up_is_refused
    limited = semaphore
    limited.acquire { :ready } # past the first use's fence
    ticket = SecureRandom.hex(16)
    limited.send(:give_up, ticket)
    assert_equal [-2, 0], limited.send(:script, NeverBlock::RedisSemaphore::Scripts::ACQUIRE, ticket)
    assert_equal 1, limited.available
    assert_equal 0, limited.waiting
  end

  def test_a_child_forked_from_a_holder_takes_permits_of_its_own
    limited = semaphore(2)
    reader, writer = IO.pipe
    limited.acquire do
      pid = fork do
        reader.close
        answer = limited.acquire(timeout: 10) { limited.available }
        writer.puts(answer)
        writer.puts(limited.acquire(timeout: 10) { :again })
        exit!(0)
      end
      writer.close
      assert_equal "0\n", reader.gets # the parent's permit, and its own
      assert_equal "again\n", reader.gets
      Process.wait(pid)
    end
    assert_equal 2, limited.available
  ensure
    reader&.close
    writer&.close unless writer&.closed?
  end

  def test_the_rate_form_grants_at_most_limit_acquisitions_in_any_window
    rate = semaphore(3, per: 1)
    started = Array.new(7) { rate.acquire { now } }
    # Sliding window: the (n+3)th acquisition comes a whole window after the nth.
    started.each_cons(4) { |first, *, fourth| assert_operator fourth - first, :>=, 0.99 }
    assert_operator started[2] - started[0], :<, 0.5, "the first three did not wait for each other"
    assert_equal 0, rate.waiting
  end

  def test_while_redis_is_down_it_fails_closed_or_runs_unbounded_when_asked
    nowhere = "unix://#{Dir.tmpdir}/neverblock-no-redis-#{Process.pid}.sock"
    error = assert_raises(NeverBlock::SemaphoreUnavailable) { semaphore(url: nowhere).acquire { flunk "ran" } }
    assert_match(/Redis did not answer for the semaphore #{@name}.*fails closed/, error.message)
    assert_kind_of RedisClient::CannotConnectError, error.cause
    log = capture_log { assert_equal :ran, semaphore(url: nowhere, unavailable: :run).acquire { :ran } }
    assert_match(/running blocks without a permit/, log)
  end

  # A Redis that answered late after its start (a loaded machine) leaves
  # the holders it forgot less than a lease of fence: the fence lasts at
  # least a renewal's interval plus twice `redis_timeout`, the time a holder
  # takes to register again. Here Redis has been up 2-3 s when the newcomer
  # asks (a 5 s lease: 3-4 s of fence left by the uptime; 7.7 s by the floor
  # with a 3 s redis_timeout), and the holder's renewal, held up meanwhile,
  # comes 5 s after the fence began. (Margins for a loaded machine: the
  # newcomer may ask up to 3 s late, the renewal may take 2.7 s.)
  def test_a_late_answering_redis_still_fences_long_enough_for_a_renewal
    dir, socket, pid = own_redis("late")
    url = "unix://#{socket}"
    holder = semaphore(url: url, lease: 5, redis_timeout: 3)
    release = Queue.new
    holding = Queue.new
    held = NeverBlock.spawn { holder.acquire { holding << true && release.pop } }
    holding.pop # its block runs (a permit granted in Redis, its reply still on the way, is not enough: see below)
    gate = Queue.new
    held_up = [true] # its next renewal only
    holder.singleton_class.prepend(Module.new { define_method(:renew) { |*args| (held_up.shift && gate.pop).then { super(*args) } } })

    admin = nil
    log = StringIO.new
    with_log(log) do
      stop_redis(pid)
      pid = nil
      pid = start_redis(dir, socket)
      admin = RedisClient.new(url: url)
      eventually { Integer(admin.call("INFO", "server")[/^uptime_in_seconds:(\d+)/, 1]) >= 2 }
      newcomer = NeverBlock.spawn { semaphore(url: url, lease: 5, redis_timeout: 3).acquire(timeout: 9) { :two_holders } }
      eventually { admin.call("EXISTS", "neverblock:semaphore:{#{@name}}:ready") == 1 } # its fence began
      sleep 5
      gate << true
      NeverBlock.logger.info("the renewal may go")
      assert_raises(NeverBlock::SemaphoreTimeout, "the log:\n#{log.string}") { newcomer.value }
    end
    assert_match(/no permit for 7666 ms/, log.string)
  ensure
    gate&.close
    release&.push(true)
    held&.wait
    holder&.close # its renewing thread ends before Redis does
    admin&.close
    stop_redis(pid, dir)
  end

  # A lease taken while the renewing thread ends (the last lease was
  # given back, and the thread, still alive, closes its connection)
  # starts a thread of its own: the ending one renews nothing more.
  def test_a_lease_taken_as_the_renewing_thread_ends_is_renewed
    limited = semaphore(1, lease: 3)
    config = limited.instance_variable_get(:@renewer).instance_variable_get(:@config)
    closing = Queue.new
    gate = Queue.new
    first = [true]
    held_at_close = Module.new do
      define_method(:close) do
        if first.shift
          closing << true
          gate.pop
        end
        super()
      end
    end
    config.define_singleton_method(:new_client) { |*args, **kw| super(*args, **kw).tap { |c| c.singleton_class.prepend(held_at_close) } }

    limited.acquire { :given_back }
    closing.pop # the renewing thread found no lease: it ends, held in its last step
    limited.acquire do
      sleep 4 # past the lease
      assert_equal 0, limited.available, "the lease ended while its block ran"
    end
  ensure
    gate << true
  end

  # A renewal that Redis refuses (BUSY: another client's script runs past
  # busy-reply-threshold) is tried again: the renewing thread does not
  # end, and the lease outlives the refusal. Redis of its own: its
  # settings change.
  def test_a_renewal_redis_refuses_is_tried_again
    dir, socket, pid = own_redis("busy")
    url = "unix://#{socket}"
    admin = RedisClient.new(url: url)
    admin.call("CONFIG", "SET", "busy-reply-threshold", "10")
    limited = semaphore(url: url, lease: 6) # renewed every 2 s: the script ends before the next renewal, 2 s to spare
    log = StringIO.new
    busy = nil
    with_log(log) do
      limited.acquire do
        busy = Thread.new do
          client = RedisClient.new(url: url, timeout: 10)
          client.call("EVAL", "while true do end", 0)
        rescue RedisClient::CommandError
          nil # killed
        ensure
          client&.close
        end
        eventually(timeout: 8) { log.string.include?("leases not renewed") }
        admin.call("SCRIPT", "KILL")
        busy.join
        sleep 6.5 # past the lease, from the last renewal before the refusal
        assert_equal 0, limited.available, "the lease ended while its block ran; the log:\n#{log.string}"
      end
    end
    assert_match(/leases not renewed: RedisClient::CommandError: BUSY/, log.string)
    assert_equal 1, limited.available
  ensure
    admin&.close
    stop_redis(pid, dir) # ends a script still running
    busy&.join
  end

  # Redis restarted without persistence forgets every lease: it grants no
  # permit until the holders it forgot registered again, so a holder that
  # runs on through the restart still counts. Leases of 3 s (renewed every
  # second): with 1 s, a holder whose renewal a loaded machine delayed past
  # the 1 s fence had not registered again when the newcomer asked, as it
  # would have lost its permit anyway. The newcomer waits 5 s, past the
  # fence, so that it is the holder's renewal that keeps it out.
  def test_after_redis_restarts_without_its_data_a_running_holder_still_counts
    dir, socket, pid = own_redis("restart")
    url = "unix://#{socket}"
    holder = semaphore(url: url, lease: 3)
    release = Queue.new
    held = nil
    log = StringIO.new
    with_log(log) do
      holding = Queue.new
      held = NeverBlock.spawn { holder.acquire { holding << true && release.pop } } # after the fence of a Redis just started
      # Its block runs. That Redis granted the permit is not enough: stopped
      # before its reply left, Redis fails the holder's acquire, which then
      # never holds (under load, a CI pass's "two holders").
      holding.pop

      stop_redis(pid)
      pid = nil
      assert_raises(NeverBlock::SemaphoreUnavailable) { semaphore(url: url, lease: 3).acquire { flunk "ran while Redis was down" } }
      pid = start_redis(dir, socket)
      NeverBlock.logger.info("Redis started again")
      assert_raises(NeverBlock::SemaphoreTimeout) do
        semaphore(url: url, lease: 3).acquire(timeout: 5) { flunk "two holders; the log:\n#{log.string}" }
      end
    end
    assert_match(/no permit for \d+ ms, while its holders register again/, log.string)

    waiter = semaphore(url: url, lease: 3)
    task = NeverBlock.spawn { waiter.acquire { :acquired } }
    eventually { waiter.waiting == 1 }
    release << true
    held.wait
    assert_equal :acquired, task.value
  ensure
    stop_redis(pid, dir)
  end

  # Redis's uptime_in_seconds is the difference of two whole-second clocks:
  # started just before a second ends, it says 1 a few ms later. The fence
  # still lasts a whole lease from the start (it lasted a second less).
  def test_the_fence_lasts_a_whole_lease_though_redis_rounds_its_uptime_up
    skip "needs redis-server on PATH" unless redis_server?
    dir = Dir.mktmpdir("neverblock-redis-fence")
    socket = File.join(dir, "redis.sock")
    sleep 0.01 until Time.now.usec.between?(750_000, 800_000)
    started = now
    pid = start_redis(dir, socket)
    client = RedisClient.new(url: "unix://#{socket}")
    eventually { client.call("INFO", "server")[/^uptime_in_seconds:(\d+)/, 1].to_i >= 1 }
    granted = nil
    log = capture_log { granted = semaphore(url: "unix://#{socket}", lease: 2).acquire { now } }
    assert_match(/no permit for \d+ ms, while its holders register again/, log)
    assert_operator granted - started, :>=, 2, "a permit came before a lease had passed since Redis started"
  ensure
    client&.close
    stop_redis(pid, dir)
  end

  private

  def start_child(env)
    reader, writer = IO.pipe
    errors = Tempfile.new("neverblock-semaphore-child")
    env = { "NB_NAME" => @name, "NB_LIMIT" => "1", "NB_LEASE" => "1", "NB_REDIS_URL" => redis_url }.merge(env)
    pid = Process.spawn(env, RbConfig.ruby, "-I#{ChildRuby::LIB}", CHILD, out: writer, err: errors.path)
    writer.close
    { pid: pid, out: reader, err: errors }.tap { |child| @children << child }
  end

  # A Redis of this test's own (OwnRedis), answering; skips the test
  # without redis-server.
  # @return [Array(String, String, Integer)] its directory, its socket's
  #   path, its pid
  def own_redis(name)
    skip "needs redis-server on PATH" unless redis_server?
    dir = Dir.mktmpdir("neverblock-redis-#{name}")
    socket = File.join(dir, "redis.sock")
    [dir, socket, start_redis(dir, socket)]
  end

  def start_redis(dir, socket)
    pid = spawn_redis(dir, socket)
    eventually { redis_answers?("unix://#{socket}") }
    pid
  end

  def redis_answers?(url)
    client = RedisClient.new(url: url)
    client.call("PING") == "PONG"
  rescue RedisClient::Error
    false
  ensure
    client&.close
  end
end
