# frozen_string_literal: true

# Loaded (`-r`) into a documented script that ReadmeTest times (`max=`):
# what is timed is the script's work, from its first NeverBlock.run to its
# exit, not Ruby's boot and the script's requires, which a loaded machine
# stretches most (five 1-second calls at once took 4.07 s as a whole process
# beside three test suites, against a 4 s limit and 5 s one after the other).
# The seconds go to the file NEVERBLOCK_README_TIMING names; a script that
# never calls NeverBlock.run writes nothing and is timed whole. NeverBlock
# is not required here, which would change the script's load order (what
# it registers depends on whether ActiveRecord loaded first): the hook goes
# in as `module NeverBlock` first opens.

module ReadmeTiming
  class << self
    # @return [Float, nil] monotonic seconds at the first NeverBlock.run.
    attr_accessor :started
  end

  def run(...)
    ReadmeTiming.started ||= Process.clock_gettime(Process::CLOCK_MONOTONIC)
    super
  end
end

hook = TracePoint.new(:class) do |event|
  next unless event.self.is_a?(Module) && event.self.name == "NeverBlock"

  event.self.singleton_class.prepend(ReadmeTiming)
  hook.disable
end
hook.enable

at_exit do
  if (started = ReadmeTiming.started)
    File.write(ENV.fetch("NEVERBLOCK_README_TIMING"), (Process.clock_gettime(Process::CLOCK_MONOTONIC) - started).to_s)
  end
end
