# frozen_string_literal: true

require "etc"

module NeverBlockBench
  # Facts about this machine and process that benchmark headers and memory
  # measurements need. Linux-specific where it reads /proc; elsewhere the
  # answers degrade to "unknown" or nil rather than failing.
  module Machine
    module_function

    # Raises the soft RLIMIT_NOFILE towards `wanted` (never above the hard
    # limit). A thousand concurrent client sockets need more than the usual
    # 1024 descriptors.
    #
    # @param wanted [Integer] number of descriptors
    # @return [Integer] the soft limit now in force
    def raise_fd_limit(wanted)
      soft, hard = Process.getrlimit(:NOFILE)
      target = hard == Process::RLIM_INFINITY ? wanted : [wanted, hard].min
      Process.setrlimit(:NOFILE, target, hard) if target > soft
      Process.getrlimit(:NOFILE).first
    end

    # @return [String] e.g. "ruby 3.1.2p20 (2022-04-12 revision 4491bb740a) [x86_64-linux-gnu]"
    def ruby_description
      RUBY_DESCRIPTION
    end

    # @return [String] "2 CPUs, Intel(R) Xeon(R) Processor, Linux 6.1.0, 23.5 GiB RAM"
    def description
      parts = ["#{Etc.nprocessors} CPUs", cpu_model, "#{Etc.uname[:sysname]} #{Etc.uname[:release]}"]
      memory = total_memory_kb
      parts << format("%.1f GiB RAM", memory / 1024.0 / 1024.0) if memory
      parts.join(", ")
    end

    # @return [String] the CPU model from /proc/cpuinfo, or "unknown CPU"
    def cpu_model
      File.foreach("/proc/cpuinfo") do |line|
        return line.split(":", 2).last.strip.squeeze(" ") if line.start_with?("model name")
      end
      "unknown CPU"
    rescue SystemCallError
      "unknown CPU"
    end

    # @return [Integer, nil] kB, from /proc/meminfo
    def total_memory_kb
      File.read("/proc/meminfo")[/^MemTotal:\s+(\d+)/, 1]&.to_i
    rescue SystemCallError
      nil
    end

    # @param field [String] a /proc/self/status field, e.g. "VmRSS", "VmHWM"
    # @return [Integer, nil] kB
    def status_kb(field)
      File.read("/proc/self/status")[/^#{field}:\s+(\d+)\s+kB/, 1]&.to_i
    rescue SystemCallError
      nil
    end

    # Resets this process's peak RSS (VmHWM) to its current RSS, so that a
    # forked child measures its own peak and not the parent's.
    #
    # @return [Boolean] false where the kernel does not support it (< 4.0)
    def reset_peak_rss
      File.write("/proc/self/clear_refs", "5")
      true
    rescue SystemCallError
      false
    end

    # Reads a kernel tunable, e.g. "kernel/pid_max".
    #
    # @return [Integer, nil]
    def sysctl(name)
      Integer(File.read("/proc/sys/#{name}").split.first)
    rescue SystemCallError, ArgumentError, TypeError
      nil
    end

    # @return [String] the 1, 5 and 15 minute load averages, e.g. "0.31 0.45 1.02"
    def load_average
      File.read("/proc/loadavg").split.first(3).join(" ")
    rescue SystemCallError
      "unknown"
    end

    # Raises a kernel tunable to at least `minimum`, writing `target` to
    # /proc/sys (what `sysctl -w` does), when it is lower. Needs root; the
    # value is left raised (these limits are system-wide: lowering it again
    # could break a concurrent run), and the caller reports the old value.
    #
    # @param name [String] e.g. "vm/max_map_count"
    # @param minimum [Integer] the value that suffices
    # @param target [Integer] the value to set when raising (>= minimum)
    # @return [Array(Symbol, Integer, Object)] [:ok, current, nil] when high
    #   enough, [:raised, old, new], [:failed, current, reason], or
    #   [:unknown, nil, nil] where there is no such tunable (not Linux)
    def raise_sysctl(name, minimum:, target: minimum)
      current = sysctl(name)
      return [:unknown, nil, nil] if current.nil?
      return [:ok, current, nil] if current >= minimum
      return [:failed, current, "not root"] unless Process.euid.zero?

      File.write("/proc/sys/#{name}", "#{[target, minimum].max}\n")
      now = sysctl(name)
      now && now >= minimum ? [:raised, current, now] : [:failed, current, "the kernel kept #{now}"]
    rescue SystemCallError => e
      [:failed, current, "#{e.class.name.split('::').last}: #{e.message}"]
    end

    # @param name [String] gem name
    # @return [String, nil] version of the gem that is (or would be) loaded
    def gem_version(name)
      Gem.loaded_specs[name]&.version&.to_s || Gem::Specification.find_by_name(name).version.to_s
    rescue Gem::MissingSpecError, LoadError
      nil
    end
  end
end
