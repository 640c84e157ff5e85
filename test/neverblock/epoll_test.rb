# frozen_string_literal: true

require "test_helper"
require "socket"
require "io/wait"
require "neverblock/server"

# NeverBlock::Epoll (ext/neverblock/epoll), the set the server's IdleSet
# parks idle connections in: a descriptor reports once per #arm, stays in the
# set disarmed after it reported, and is re-armed in place.
class EpollTest < PlainTest
  def setup
    skip "no NeverBlock::Epoll (the C extension is built on Linux only)" unless defined?(NeverBlock::Epoll)
    @epoll = NeverBlock::Epoll.new
    @a, @b = UNIXSocket.pair
  end

  def teardown
    @epoll&.close
    [@a, @b].each { |socket| socket&.close unless socket&.closed? }
  end

  def test_a_readable_descriptor_reports_once_per_arm
    assert @epoll.arm(@a.fileno), "added"
    assert_empty @epoll.ready
    @b.write("x")
    assert_equal [@a.fileno], @epoll.ready
    assert_empty @epoll.ready, "reported again while still readable"
    refute @epoll.arm(@a.fileno), "re-armed in place, not added"
    assert_equal [@a.fileno], @epoll.ready, "re-armed while readable: reports at once"
  end

  def test_arming_an_armed_descriptor_reports_it_once
    assert @epoll.arm(@a.fileno)
    refute @epoll.arm(@a.fileno)
    @b.write("x")
    assert_equal [@a.fileno], @epoll.ready
    assert_empty @epoll.ready
  end

  def test_the_peers_close_reports
    @epoll.arm(@a.fileno)
    @b.close
    assert_equal [@a.fileno], @epoll.ready
  end

  def test_a_deleted_descriptor_does_not_report
    @epoll.arm(@a.fileno)
    assert @epoll.delete(@a.fileno)
    refute @epoll.delete(@a.fileno), "not in the set any more"
    @b.write("x")
    assert_empty @epoll.ready
    assert @epoll.arm(@a.fileno), "added again"
    assert_equal [@a.fileno], @epoll.ready
  end

  # The kernel drops a closed descriptor from the set: a socket that takes
  # its number is added afresh, and only it reports.
  def test_a_closed_descriptor_leaves_the_set
    fd = @a.fileno
    @epoll.arm(fd)
    @a.close # (its peer's hang-up would report, were it still in the set)
    assert_empty @epoll.ready
    assert_raises(Errno::EBADF) { @epoll.arm(fd) }
    c, d = UNIXSocket.pair
    begin
      skip "the descriptor's number was not reused" unless c.fileno == fd || d.fileno == fd
      reused = c.fileno == fd ? c : d
      assert @epoll.arm(fd), "added: the old socket's entry went with it"
      (reused.equal?(c) ? d : c).write("y")
      assert_equal [fd], @epoll.ready
    ensure
      c.close
      d.close
    end
  end

  def test_the_set_is_readable_while_a_descriptor_reports
    @epoll.arm(@a.fileno)
    io = IO.for_fd(@epoll.fileno, autoclose: false)
    refute io.wait_readable(0), "readable with nothing ready"
    @b.write("x")
    assert io.wait_readable(1)
    @epoll.ready
    refute io.wait_readable(0), "readable after its one report"
  end

  def test_a_closed_set_raises
    @epoll.close
    assert @epoll.closed?
    @epoll.close # a no-op
    assert_raises(IOError) { @epoll.arm(@a.fileno) }
    assert_raises(IOError) { @epoll.ready }
  end
end
