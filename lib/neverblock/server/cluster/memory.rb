# frozen_string_literal: true

module NeverBlock
  class Server
    class Cluster
      # A worker's memory, as the master reads it from Linux's /proc for
      # `max_memory` ({Settings}): RSS from `/proc/PID/status` (cheap), or PSS
      # from `/proc/PID/smaps_rollup` (Linux 4.14+; the kernel walks the
      # process's mappings for it, so it costs more).
      module Memory
        # @param pid [Integer]
        # @param metric [Symbol] `:rss` or `:pss`.
        # @return [Integer, nil] bytes; nil when the process is gone or the
        #   file cannot be read (not Linux).
        def self.of(pid, metric)
          if metric == :pss
            kilobytes(File.read("/proc/#{pid}/smaps_rollup"), "Pss")
          else
            kilobytes(File.read("/proc/#{pid}/status"), "VmRSS")
          end
        rescue SystemCallError
          nil
        end

        # @return [Integer, nil] the `FIELD: N kB` line of `text`, in bytes.
        def self.kilobytes(text, field)
          value = text[/^#{field}:\s+(\d+) kB$/, 1]
          value && Integer(value, 10) * 1024
        end

        # @return [Integer] `bytes` in whole MiB, for the log.
        def self.mb(bytes)
          (bytes / (1024.0 * 1024)).round
        end
      end
    end
  end
end
