"""A spec-built environment: the data below, run by spec_env.SpecEnv (sandbox/image/spec_env.py)."""
from spec_env import SpecEnv

SPEC = {'name': 'exact_arguments',
 'entities': {'ticket': {'count': [3, 6], 'fields': {'ticket_id': {'type': 'id', 'pattern': 'T{n:04d}'}}}},
 'task': {'record': {'type': 'pick', 'entity': 'ticket'},
          'stated_content': {'type': 'choice',
                             'values': ['content_1042',
                                        'content_2387',
                                        'content_3719',
                                        'content_4560',
                                        'content_5823']},
          'stated_reminder_timestamp': {'type': 'int', 'min': 1, 'max': 9},
          'stated_latitude': {'type': 'int', 'min': 1, 'max': 9}},
 'tools': {'add_reminder': {'kind': 'const', 'result': 'Done.'}},
 'system_prompt': 'You are a customer service agent. Use the tools to do what the user asks, then tell them. '
                  'Call each tool once, with exactly the values the user gives.',
 'user_message': 'Content, reminder timestamp, latitude, longitude. My content is {task.stated_content}. My '
                 'reminder timestamp is {task.stated_reminder_timestamp}. My latitude is '
                 '{task.stated_latitude}.',
 'reference': [{'call': 'add_reminder',
                'args': {'content': '{task.stated_content}',
                         'reminder_timestamp': '{task.stated_reminder_timestamp}',
                         'latitude': '{task.stated_latitude}'}},
               {'reply': 'Done.'}],
 'reward': [{'name': 'every_value',
             'weight': 0.6,
             'pred': {'op': 'called',
                      'tool': 'add_reminder',
                      'args': {'content': '{task.stated_content}',
                               'reminder_timestamp': '{task.stated_reminder_timestamp}',
                               'latitude': '{task.stated_latitude}'}}},
            {'name': 'first_try',
             'weight': 0.4,
             'pred': {'op': 'called',
                      'tool': 'add_reminder',
                      'args': {'content': '{task.stated_content}',
                               'reminder_timestamp': '{task.stated_reminder_timestamp}',
                               'latitude': '{task.stated_latitude}'},
                      'only': True}}]}

TOOLS = [{'type': 'function',
  'function': {'name': 'add_reminder',
               'description': 'Add a reminder',
               'parameters': {'type': 'object',
                              'properties': {'content': {'type': 'string',
                                                         'description': 'Content of the reminder'},
                                             'reminder_timestamp': {'type': 'number',
                                                                    'description': 'When the user wants to '
                                                                                   'be reminded. Expressed '
                                                                                   'in POSIX timestamp'},
                                             'latitude': {'type': 'number',
                                                          'description': 'Optional. Latitude of the location '
                                                                         'associated with this reminder'},
                                             'longitude': {'type': 'number',
                                                           'description': 'Optional. Longitude of the '
                                                                          'location associated with this '
                                                                          'reminder'}},
                              'required': ['content', 'reminder_timestamp']}}}]

POLICY = "Don't make assumptions about what values to plug into functions. Ask for clarification if a user request is ambiguous."


class Env(SpecEnv):
    SPEC = SPEC
    TOOLS = TOOLS
    POLICY = POLICY
