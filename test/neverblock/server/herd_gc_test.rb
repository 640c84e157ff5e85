# frozen_string_literal: true

require_relative "server_helper"

# While a herd of connections starts (a backlog the acceptor takes in a
# batch or more at once), major GCs are held off on Ruby 3.4+
# (GC.config(rgengc_allow_full_mark: false)): Ruby grows its heap for the
# herd at a minor GC instead of marking all of it. The hold ends
# HerdGC::AFTER after the herd's last connection started, HerdGC::LONGEST
# after it began at the latest, at the server's stop and in a forked child;
# it leaves alone full marking the app turned off, and none begins within
# HerdGC::REST of the last. The app here answers whether full marking was
# on when it ran.
class ServerHerdGCTest < PlainTest
  include ServerHelper

  HerdGC = NeverBlock::Server::HerdGC
  BACKLOG = 150 # over Acceptor::BATCH (64): a herd

  def setup
    super
    skip "GC.config(rgengc_allow_full_mark:) is Ruby 3.4+" unless full_marking_setting?
    skip "NEVERBLOCK_HERD_GC=off" if ENV["NEVERBLOCK_HERD_GC"] == "off"
    HerdGC.reset
  end

  def teardown
    super
  ensure
    if full_marking_setting?
      HerdGC.reset
      GC.config(rgengc_allow_full_mark: true)
    end
  end

  def test_a_herd_runs_with_major_gcs_held_off_and_they_are_back_after_it
    with_constant(HerdGC, :LONGEST, 600.0) do # ended by the herd's end, not the longest hold
      answers = herd_answers
      assert_operator answers.count("off"), :>=, BACKLOG / 2, "answers: #{answers.tally}"
      eventually(timeout: 20) { !HerdGC.holding? }
      assert GC.config[:rgengc_allow_full_mark]
      assert_equal "on", answer_of_one
    end
  end

  # An app doing its own out-of-band GC turns full marking off itself: the
  # herd neither holds it nor turns it back on.
  def test_full_marking_the_app_turned_off_stays_off
    GC.config(rgengc_allow_full_mark: false)
    assert_equal ["off"], herd_answers.uniq
    refute HerdGC.holding?
    sleep HerdGC::AFTER + 0.2
    refute GC.config[:rgengc_allow_full_mark]
  end

  def test_a_stop_ends_the_hold
    with_constant(HerdGC, :AFTER, 60.0) do # no timer ends it before the stop
      with_constant(HerdGC, :LONGEST, 600.0) { herd_answers }
      assert HerdGC.holding?
      @server.stop
      assert @server_thread.join(20), "server did not stop"
      @server = nil
      refute HerdGC.holding?
      assert GC.config[:rgengc_allow_full_mark]
    end
  end

  def test_no_hold_begins_within_the_rest_after_one
    with_constant(HerdGC, :AFTER, 0.1) do
      assert_includes herd_answers, "off"
      eventually(timeout: 10) { !HerdGC.holding? }
      assert_equal ["on"], herd_answers.uniq, "a second herd at once"
    end
  end

  def test_the_environment_can_turn_the_hold_off
    ENV["NEVERBLOCK_HERD_GC"] = "off"
    HerdGC.recheck
    assert_equal ["on"], herd_answers.uniq
    refute HerdGC.holding?
  ensure
    ENV.delete("NEVERBLOCK_HERD_GC")
    HerdGC.recheck
  end

  # A herd that goes on starting (the loop keeps taking in connections)
  # holds major GCs off for HerdGC::LONGEST at most.
  def test_a_hold_ends_after_the_longest_however_long_the_herd
    with_constant(HerdGC, :LONGEST, 0.3) do
      NeverBlock.run do
        scheduler = NeverBlock.current_scheduler!
        HerdGC.herd_starting(scheduler)
        assert HerdGC.holding?
        refute GC.config[:rgengc_allow_full_mark]
        sleep 0.6
        refute HerdGC.holding?
        assert GC.config[:rgengc_allow_full_mark]
      ensure
        HerdGC.herd_started(scheduler)
      end
    end
  end

  # GC.config is the process's, and a child forked during a hold serves no
  # herd of its parent's: it has full marking back.
  def test_a_child_forked_during_a_hold_has_full_marking_on
    skip "no fork" unless Process.respond_to?(:fork)
    NeverBlock.run do
      scheduler = NeverBlock.current_scheduler!
      HerdGC.herd_starting(scheduler)
      reader, writer = IO.pipe
      pid = fork do
        reader.close
        writer.write(GC.config[:rgengc_allow_full_mark] && !HerdGC.holding? ? "on" : "off")
        exit!(0)
      end
      writer.close
      assert_equal "on", reader.read
      Process.wait(pid)
      assert HerdGC.holding?, "the parent's hold goes on"
    ensure
      HerdGC.herd_started(scheduler)
      HerdGC.release
    end
  end

  private

  # Holds the server's loop while BACKLOG connections queue, then lets
  # them in (a herd, taken in on one turn): each one's answer.
  def herd_answers
    @held = Queue.new
    @release = Queue.new
    unless @server
      test = self
      app = lambda do |env|
        test.hold_the_loop if env["PATH_INFO"] == "/hold"
        [200, { "content-type" => "text/plain" }, [GC.config[:rgengc_allow_full_mark] ? "on" : "off"]]
      end
      start_server(app, adaptive_limit: false)
    end
    holder = send_without_waiting(@port, get("/hold"))
    @held.pop
    waiting = Array.new(BACKLOG) { send_without_waiting(@port, get("/n")) }
    @release << true
    read_response(holder, timeout: 30)
    waiting.map { |socket| read_response(socket, timeout: 60)[2] }
  end

  public

  # The loop's thread stops here while the test fills the backlog.
  def hold_the_loop
    @held << true
    Fiber.new(blocking: true) { @release.pop }.resume
  end

  private

  def full_marking_setting?
    GC.respond_to?(:config) && GC.config.key?(:rgengc_allow_full_mark)
  end

  def answer_of_one
    socket = connect
    socket.write(get("/n"))
    read_response(socket)[2]
  end
end
