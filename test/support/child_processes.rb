# frozen_string_literal: true

require "timeout"

# Stopping the `neverblock` processes a test started: each a Hash with the
# child's `:pid` and `:out` (the read end of its output pipe).
module ChildProcesses
  # Sends each child TERM and waits for it (20 s at most, then KILL); closes
  # its output pipe. Children already gone are skipped.
  # @param children [Array<Hash>]
  # @return [void]
  def stop_children(children)
    children.each do |child|
      Process.kill("TERM", child[:pid])
      Timeout.timeout(20) { Process.wait(child[:pid]) }
    rescue Errno::ESRCH, Errno::ECHILD
      nil
    rescue Timeout::Error
      Process.kill("KILL", child[:pid])
      Process.wait(child[:pid])
    ensure
      child[:out].close
    end
  end
end
