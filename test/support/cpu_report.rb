# frozen_string_literal: true

# NEVERBLOCK_TEST_CPU=N bin/test: after the run, the N tests that cost the
# most CPU (this process, and the child processes each test waited for:
# servers, child Rubies, their workers), to find what makes a pass slow on a
# busy machine. Off unless the variable is set.
module CpuReport
  @costs = []

  class << self
    # @return [Array<Array(Float, Float, String)>] [own, children, test] seconds
    attr_reader :costs

    # Prints the costliest `count` tests and the total.
    # @return [void]
    def print(count, out = $stdout)
      own = costs.sum { |cost| cost[0] }
      children = costs.sum { |cost| cost[1] }
      out.puts format("\nCPU of %d tests: %.1f s in the test process, %.1f s in child processes; the costliest %d:",
                      costs.size, own, children, count)
      costs.max_by(count) { |cost| cost[0] + cost[1] }.each do |cost_own, cost_children, name|
        out.puts format("%7.2f s %7.2f s + %7.2f s  %s", cost_own + cost_children, cost_own, cost_children, name)
      end
    end
  end

  # Minitest::Test#run, measured.
  def run
    before = Process.times
    result = super
    after = Process.times
    CpuReport.costs << [after.utime + after.stime - before.utime - before.stime,
                        after.cutime + after.cstime - before.cutime - before.cstime,
                        "#{self.class.name}##{name}"]
    result
  end
end

if (count = Integer(ENV.fetch("NEVERBLOCK_TEST_CPU", "0"), exception: false)) && count.positive?
  Minitest::Test.prepend(CpuReport)
  Minitest.after_run { CpuReport.print(count) }
end
