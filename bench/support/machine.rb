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

    # @param name [String] gem name
    # @return [String, nil] version of the gem that is (or would be) loaded
    def gem_version(name)
      Gem.loaded_specs[name]&.version&.to_s || Gem::Specification.find_by_name(name).version.to_s
    rescue Gem::MissingSpecError, LoadError
      nil
    end
  end
end
