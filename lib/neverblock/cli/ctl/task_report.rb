# frozen_string_literal: true

require "json"

module NeverBlock
  class CLI
    class Ctl
      # `neverblock ctl tasks` as a person reads it: the control listener's
      # `/tasks` answer is JSON (`{"workers": [{"index":, "pid":, "tasks":}]}`,
      # each worker's task dump a string, for scripts); this prints each
      # worker's dump as the text it is, under a line naming the worker.
      module TaskReport
        # @param body [String] the `/tasks` answer.
        # @return [String] the text, several lines; the body as it came when
        #   it is not such JSON.
        def self.render(body)
          workers = JSON.parse(body).fetch("workers")
          return "no worker is serving (yet)" if workers.empty?

          workers.map { |worker| section(worker) }.join("\n\n")
        rescue JSON::ParserError, KeyError, TypeError, NoMethodError
          body
        end

        def self.section(worker)
          head = "worker #{worker['index']} (pid #{worker['pid']})"
          dump = worker["tasks"]
          return "#{head}: did not answer in time (its loop may be held; QUIT to it logs its tasks)" if dump.nil?

          "#{head}:\n#{dump}"
        end
        private_class_method :section
      end
    end
  end
end
